"""VllmRunner (vLLM's engine behind the Runner interface) scores like the own runner.

Needs vLLM, so it runs in the vLLM virtualenv with the conformance suite:
    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_runner.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from specdec.runner import ModelRunner  # noqa: E402
from specdec.tiny import make_tiny_model  # noqa: E402
from specdec.vllm_runner import VllmRunner  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, tokenizer_dir):
    # head_dim 64: a size every vLLM CPU attention backend takes.
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", tokenizer_dir, num_layers=2,
                           hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def runners(tiny_target, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes half the RAM
    return (VllmRunner(tiny_target, dtype="float32", max_model_len=512, max_num_seqs=4,
                       enforce_eager=True, gpu_memory_utilization=0.1),
            ModelRunner(tiny_target, dtype="float32"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


PROMPTS = [[(13 * i + 7 * r) % 5000 + 100 for i in range(70 + 9 * r)] for r in range(3)]


def test_verify_rows_match_the_own_runner_and_read_the_prefix_cache(runners):
    vllm_runner, own = runners
    k = 3
    for runner in runners:
        runner.extend([(f"r{i}", p, 1) for i, p in enumerate(PROMPTS)])
    # A verify: each request's prompt plus K+1 further tokens, K+1 rows of logits back.
    items = [(f"r{i}", p + [11, 12, 13, 14][: k + 1], k + 1) for i, p in enumerate(PROMPTS)]
    theirs, ours = vllm_runner.extend(items), own.extend(items)
    for t, o in zip(theirs, ours):
        assert t.shape == o.shape == (k + 1, own.vocab_size)
        assert torch.allclose(t, o, atol=1e-3, rtol=1e-3), float((t - o).abs().max())
        assert torch.equal(t.argmax(-1), o.argmax(-1))
    # Every prompt's first full blocks came from the cache, not a new prefill.
    block = vllm_runner.llm.llm_engine.vllm_config.cache_config.block_size
    assert vllm_runner.last_cached_tokens == [len(p) // block * block for p in PROMPTS]


def test_a_one_row_call_is_the_next_token_distribution(runners):
    vllm_runner, own = runners
    item = [("solo", PROMPTS[0][:40], 1)]
    theirs, ours = vllm_runner.extend(item)[0], own.extend(item)[0]
    assert theirs.shape == (1, own.vocab_size)
    assert torch.allclose(theirs, ours, atol=1e-3, rtol=1e-3)


def test_rows_inside_a_cached_prefix_are_recomputed(runners):
    vllm_runner, own = runners
    block = vllm_runner.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = PROMPTS[1][: 2 * block]  # whole blocks: the next call's hit covers its last rows
    for runner in runners:
        runner.extend([("cached", prompt, 1)])
    item = [("cached", prompt + [42], 3)]  # rows at the prompt's last two positions and the new one
    theirs, ours = vllm_runner.extend(item)[0], own.extend(item)[0]
    assert vllm_runner.last_cached_tokens == [0]  # ran again without the cache
    assert torch.allclose(theirs, ours, atol=1e-3, rtol=1e-3)
