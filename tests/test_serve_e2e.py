"""End-to-end through real Ray Serve: Draft, Target and Coordinator deployments on the tiny
random-weight pair (float32), called through Python handles."""

from __future__ import annotations

import concurrent.futures

import pytest

from specdec.errors import ContextLengthError
from specdec.local import LocalEngine

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')


PROMPT = "def quicksort(items):"


@pytest.fixture(scope="module")
def handle(serve_tiny_app):
    return serve_tiny_app


def generate(handle, prompt=PROMPT, **params):
    return handle.generate.remote({"prompt": prompt, "sampling_params": params}).result()


def test_greedy_matches_in_process_engine_and_target_only(handle, tiny_pair):
    served = generate(handle, temperature=0, max_tokens=20, ignore_eos=True)
    target_only = generate(handle, temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0)
    local = LocalEngine(*tiny_pair, num_speculative_tokens=3, dtype="float32").generate(
        [{"prompt": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 20, "ignore_eos": True}}]
    )[0]
    assert served.token_ids == target_only.token_ids == local.token_ids
    assert served.speculation.rounds < 20  # speculation really ran
    assert served.usage.completion_tokens == 20 and served.finish_reason == "length"


def test_stream_deltas_add_up_to_the_result(handle):
    params = {"temperature": 0.7, "seed": 7, "max_tokens": 15, "ignore_eos": True}
    deltas = list(
        handle.options(stream=True).generate_stream.remote({"prompt": PROMPT, "sampling_params": params})
    )
    whole = generate(handle, **params)
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finish_reason == "length" and deltas[-1].seed == 7
    assert all(d.finish_reason is None for d in deltas[:-1])


@pytest.mark.parametrize("mode", [{}, {"drafter_invariant": False}], ids=["default", "standard"])
def test_seeded_output_unchanged_beside_concurrent_requests(handle, mode):
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 99, "max_tokens": 16, "ignore_eos": True, **mode}
    alone = generate(handle, **params)
    again = generate(handle, **params)
    others = [
        handle.generate.remote({"prompt": "x " * (3 + 5 * i), "sampling_params": {"max_tokens": 8 + 2 * i, "temperature": 1.0}})
        for i in range(8)
    ]
    crowded = generate(handle, **params)
    assert all(r.result().usage.completion_tokens > 0 for r in others)
    assert alone.token_ids == again.token_ids == crowded.token_ids


def test_bad_requests_fail_clearly_and_neighbours_finish(handle):
    good = [
        handle.generate.remote({"prompt": PROMPT, "sampling_params": {"max_tokens": 12, "seed": i}})
        for i in range(4)
    ]
    with pytest.raises(Exception, match="top_p"):
        generate(handle, top_p=1.5)
    with pytest.raises(ContextLengthError, match="maximum context length"):
        generate(handle, max_tokens=10**6)
    with pytest.raises(Exception, match="n > 1|n must be 1|only n=1|n=1"):
        generate(handle, n=3)
    assert [r.result().usage.completion_tokens for r in good] == [12] * 4


def test_handle_accepts_token_ids_and_plain_strings(handle):
    ids = handle.generate.remote([1, 2, 3, 4], {"temperature": 0, "max_tokens": 4}).result()
    text = handle.generate.remote("hello", {"temperature": 0, "max_tokens": 4}).result()
    assert ids.usage.prompt_tokens == 4 and len(ids.token_ids) <= 4
    assert text.usage.prompt_tokens >= 1


def test_many_concurrent_requests_all_complete(handle):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(generate, handle, "p" * (i + 1), max_tokens=6, seed=i, ignore_eos=True)
            for i in range(24)
        ]
        results = [f.result() for f in futures]
    assert all(r.usage.completion_tokens == 6 for r in results)
