"""ModelRunner: prefix reuse, cropping, batching of requests, capacity and context limits."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import CapacityError, ContextLengthError, RequestError
from specdec.kernels import FORMATS
from specdec.runner import ModelRunner

from kernel_emulation import split_k


def _prompt(n, seed=0):
    return torch.randint(0, 150_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runner_factory(tiny_pair):
    def make(**kw):
        kw.setdefault("dtype", "float32")
        return ModelRunner(tiny_pair[1], **kw)

    return make


def _count_fed(runner):
    """Wraps the model's forward to record how many tokens each call feeds."""
    fed = []
    forward = runner.model.forward

    def counting(tokens, *args):
        fed.append(len(tokens))
        return forward(tokens, *args)

    runner.model.forward = counting
    return fed


def test_incremental_extend_equals_full_forward(runner_factory):
    ids = _prompt(40)
    full = runner_factory().extend([("a", ids, len(ids))])[0]
    runner = runner_factory()
    fed = _count_fed(runner)
    got = [runner.extend([("a", ids[:10], 10)])[0]]
    for end in (11, 12, 17, 25, 40):  # one token at a time, then verify-sized chunks
        got.append(runner.extend([("a", ids[:end], end - (len(torch.cat(got))))])[0])
    torch.testing.assert_close(torch.cat(got), full, atol=1e-4, rtol=1e-4)
    assert fed == [10, 1, 1, 5, 8, 15]  # only new tokens are fed
    assert runner.cache_usage()["tokens"] == 40


def test_refeeds_cached_positions_whose_logits_are_asked_for(runner_factory):
    ids = _prompt(20, seed=1)
    full = runner_factory().extend([("a", ids, 20)])[0]
    runner = runner_factory()
    runner.extend([("a", ids, 1)])
    fed = _count_fed(runner)
    again = runner.extend([("a", ids, 3)])[0]
    assert fed == [3]
    torch.testing.assert_close(again, full[-3:], atol=1e-4, rtol=1e-4)


def test_mismatching_suffix_is_cropped(runner_factory):
    """Rejected proposals leave the cache: A+B cached, then A+C asked for."""
    a, b, c = _prompt(15, seed=2), _prompt(6, seed=3), _prompt(4, seed=4)
    fresh = runner_factory().extend([("x", a + c, 4)])[0]
    runner = runner_factory()
    runner.extend([("x", a + b, 1)])
    fed = _count_fed(runner)
    got = runner.extend([("x", a + c, 4)])[0]
    assert fed == [4]  # a reused, c fed
    torch.testing.assert_close(got, fresh, atol=1e-4, rtol=1e-4)
    assert runner.cache_usage()["tokens"] == len(a) + len(c)
    # a shorter list (a strict prefix) crops too; asking for its last logit re-feeds one token
    got = runner.extend([("x", a[:10], 1)])[0]
    torch.testing.assert_close(got, runner_factory().extend([("y", a[:10], 1)])[0],
                               atol=1e-4, rtol=1e-4)
    assert fed == [4, 1] and runner.cache_usage()["tokens"] == 10


def _alone_and_together(runner_factory, **kw):
    """Logits of requests of different lengths, each alone and all in one call (one in
    prefill, others decoding or verifying)."""
    prompts = {"p": _prompt(30, seed=5), "q": _prompt(7, seed=6), "r": _prompt(19, seed=7)}
    alone = {}
    for rid, ids in prompts.items():  # the same per-request history as below
        runner = runner_factory(**kw)
        if rid != "p":
            runner.extend([(rid, ids[:-3], 1)])
        alone[rid] = runner.extend([(rid, ids, 3)])[0]
    runner = runner_factory(**kw)
    runner.extend([("q", prompts["q"][:-3], 1), ("r", prompts["r"][:-3], 1)])
    fed = _count_fed(runner)
    # "p" is new (prefill of 30); q and r add 3 tokens each
    out = runner.extend([(rid, ids, 3) for rid, ids in prompts.items()])
    assert fed == [36]
    return alone, dict(zip(prompts, out))


def test_requests_of_different_lengths_in_one_call_match_each_alone(runner_factory):
    alone, together = _alone_and_together(runner_factory)
    for rid in alone:
        torch.testing.assert_close(together[rid], alone[rid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", FORMATS)
def test_batch_invariant_mode_is_bitwise_equal(runner_factory, dtype):
    alone, together = _alone_and_together(runner_factory, dtype=dtype, batch_invariant=True)
    for rid in alone:
        assert torch.equal(together[rid], alone[rid]), rid


def _logits_by_schedule(runner, ids, prompt_len, ends):
    """Logits for positions prompt_len-1 .. len(ids)-1 of one request, fed in chunks ending
    at `ends` (a prefill of the prompt first)."""
    got = [runner.extend([("r", ids[:prompt_len], 1)])[0]]
    done = prompt_len
    for end in ends:
        got.append(runner.extend([("r", ids[:end], end - done)])[0])
        done = end
    runner.release("r")
    return torch.cat(got)


@pytest.mark.parametrize("dtype", FORMATS)
def test_batch_invariant_mode_is_invariant_to_how_positions_are_fed(runner_factory, dtype):
    """A position's logits are bit-identical whether it comes in a whole prefill, a K+1-row
    verify or a one-token decode (so greedy speculative == greedy target-only exactly, and a
    re-prefill after failover changes nothing)."""
    ids, prompt_len = _prompt(48, seed=3), 12
    runner = runner_factory(dtype=dtype, batch_invariant=True)
    got = {name: _logits_by_schedule(runner, ids, prompt_len, ends)
           for name, ends in SCHEDULES.items()}
    assert [torch.equal(got["decode"], got[name]) for name in ("prefill", "verify")] == [True, True]


SCHEDULES = {"prefill": [48], "verify": list(range(17, 48, 5)) + [48], "decode": list(range(13, 49))}


def test_calibration_picks_an_invariant_kernel_for_a_shape_dependent_gemm(runner_factory, monkeypatch, tmp_path):
    """With an emulated GPU-like GEMM whose reduction split depends on the row count, the
    calibration rejects the native kernel and the runner stays bitwise invariant; bypassing
    the calibration (native kernels forced) makes the same check fail."""
    from specdec import kernels
    from specdec.kernels import Kernel

    monkeypatch.setattr(kernels, "_cache_file", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(kernels, "_op", split_k(kernels._op))
    ids, prompt_len = _prompt(48, seed=3), 12
    results = {}
    for mode in ("calibrated", "bypassed"):
        runner = runner_factory(dtype="float32", batch_invariant=True)
        if mode == "bypassed":
            runner.model.use_kernels({s: Kernel("float32", "linear", None) for s in runner.model.weight_shapes()})
        else:
            assert all(":b" in name or name.endswith(":pad")
                       for name in runner.calibration()["kernels"].values())
        got = {name: _logits_by_schedule(runner, ids, prompt_len, ends)
               for name, ends in SCHEDULES.items()}
        results[mode] = [torch.equal(got["decode"], got[name]) for name in ("prefill", "verify")]
    assert results["calibrated"] == [True, True]
    assert results["bypassed"] != [True, True]


@pytest.mark.parametrize("kernel", ["float32:wxt:b32", "float32:linear:b4", "float32:wxt:b4"])
def test_a_blocked_kernel_is_invariant_to_how_positions_are_fed(runner_factory, monkeypatch, kernel):
    """Every blocked kernel is invariant by construction, whichever one the calibration's
    timing picks: `wxt` returns a transposed result, and a layout that depends on the row
    count would change the next (row-count dependent) matmul's path."""
    from specdec import kernels
    from specdec.kernels import Kernel

    monkeypatch.setattr(kernels, "_op", split_k(kernels._op))
    runner = runner_factory(dtype="float32")
    runner.model.use_kernels({s: Kernel.parse(kernel) for s in runner.model.weight_shapes()})
    ids, prompt_len = _prompt(48, seed=3), 12
    got = {name: _logits_by_schedule(runner, ids, prompt_len, ends) for name, ends in SCHEDULES.items()}
    assert [torch.equal(got["decode"], got[name]) for name in ("prefill", "verify")] == [True, True]


def test_capacity_error_when_the_call_alone_does_not_fit(runner_factory):
    runner = runner_factory(max_cache_tokens=64)  # 4 blocks of 16
    runner.extend([("a", _prompt(20), 1)])
    with pytest.raises(CapacityError, match="needs 6 cache blocks .80 tokens.*max_cache_tokens=64"):
        runner.extend([("b", _prompt(40, seed=1), 1), ("c", _prompt(40, seed=2), 1)])
    assert runner.cache_usage()["tokens"] == 20  # nothing changed


def test_lru_eviction_of_requests_outside_the_call(runner_factory):
    runner = runner_factory(max_cache_tokens=80)  # 5 blocks
    a, b, c = _prompt(20, seed=1), _prompt(20, seed=2), _prompt(20, seed=3)
    runner.extend([("a", a, 1)])
    runner.extend([("b", b, 1)])
    runner.extend([("a", a + [5], 1)])  # a is now the most recently used
    runner.extend([("c", c, 1)])  # 2 + 2 + 2 blocks > 5: b goes
    usage = runner.cache_usage()
    assert usage["sequences"] == 2 and usage["tokens"] == 41 and usage["blocks_used"] == 4
    fed = _count_fed(runner)
    runner.extend([("a", a + [5, 6], 1)])
    runner.extend([("b", b, 1)])  # b re-prefills; c (least recent) is evicted for it
    assert fed == [1, 20]
    assert runner.cache_usage()["tokens"] == 42


def test_kv_pool_is_allocated_once_and_used_in_blocks(runner_factory):
    runner = runner_factory()
    ids = _prompt(10)
    runner.extend([("a", ids, 1)])
    pool = runner.pool.k.data_ptr()
    for t in range(100):
        ids = ids + [t]
        runner.extend([("a", ids, 1)])
    usage = runner.cache_usage()
    assert runner.pool.k.data_ptr() == pool  # no reallocation, ever
    assert usage["tokens"] == 110 and usage["blocks_used"] == 7  # ceil(110 / 16)
    runner.extend([("a", ids[:40], 1)])  # a crop hands blocks back
    assert runner.cache_usage()["blocks_used"] == 3
    runner.release("a")
    assert runner.cache_usage()["blocks_used"] == 0


def test_release(runner_factory):
    runner = runner_factory()
    runner.extend([("a", _prompt(5), 1), ("b", _prompt(6), 1)])
    runner.release("a")
    runner.release("unknown")  # no error
    assert runner.cache_usage()["sequences"] == 1 and runner.cache_usage()["tokens"] == 6


def test_context_length_and_bad_input(runner_factory):
    runner = runner_factory()
    assert runner.max_context == 2048  # the tiny model's max_position_embeddings
    with pytest.raises(ContextLengthError, match="2049 tokens exceed the model's context of 2048"):
        runner.extend([("a", [1] * 2049, 1)])
    with pytest.raises(RequestError, match="token ids must lie in"):
        runner.extend([("a", [1, runner.vocab_size], 1)])
    with pytest.raises(RequestError, match="appears twice"):
        runner.extend([("a", [1, 2], 1), ("a", [1, 2], 1)])
    with pytest.raises(RequestError, match="num_logits"):
        runner.extend([("a", [1, 2], 3)])
    with pytest.raises(RequestError, match="empty"):
        runner.extend([("a", [], 0)])
    assert runner.cache_usage()["sequences"] == 0
    # num_logits=0 just fills the cache
    assert runner.extend([("a", [1, 2, 3], 0)])[0].shape == (0, runner.vocab_size)
    assert runner.cache_usage()["tokens"] == 3
