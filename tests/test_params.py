"""SamplingParams: validation messages, from_any, JSON round trip, draw_seed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from specdec.errors import RequestError
from specdec.params import SamplingParams, draw_seed


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_p", 1.5, "top_p must be in (0, 1] (1 = off), got 1.5"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("temperature", -0.1, "temperature must be in [0, 2] (0 = greedy), got -0.1"),
        ("temperature", 2.5, "temperature must be in [0, 2]"),
        ("temperature", float("nan"), "temperature must be in [0, 2]"),
        ("top_k", -2, "top_k must be 0 or -1 (off) or at least 1, got -2"),
        ("min_p", 1.1, "min_p must be in [0, 1] (0 = off), got 1.1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2] (0 = off), got 2.5"),
        ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
        ("seed", -1, "seed must be in [0, 2**63) or null"),
        ("seed", 2**63, "seed must be in [0, 2**63)"),
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("min_tokens", -1, "min_tokens must be at least 0, got -1"),
        ("logprobs", 21, "logprobs must be in [0, 20] or null (none), got 21"),
        ("logprobs", -1, "logprobs must be in [0, 20]"),
        ("num_speculative_tokens", 17, "num_speculative_tokens must be in [0, 16]"),
        ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids must be token ids >= 0, got [-1]"),
        ("stop_token_ids", [-5], "stop_token_ids must be token ids >= 0"),
        ("stop", ["ok", ""], "stop must not contain an empty string"),
        ("bad_words", [""], "bad_words must not contain an empty string"),
        ("logit_bias", {"x": 1.0}, "logit_bias keys must be token ids (integers), got 'x'"),
        ("logit_bias", {-3: 1.0}, "logit_bias keys must be token ids >= 0, got -3"),
        ("logit_bias", {3: float("nan")}, "logit_bias[3] must be a number in [-100, 100], got NaN"),
        ("target_probs", "bogus", "target_probs"),
    ],
)
def test_invalid_values_say_what_to_change(field, value, message):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert message in str(info.value)
    assert info.value.errors()[0]["loc"] in ((field,), (field, 0), (field, "x"))


def test_n_greater_than_one_is_refused_with_a_reason():
    with pytest.raises(ValidationError, match="n must be 1, got 4: this service returns one sequence"):
        SamplingParams(n=4)
    assert SamplingParams(n=1).n == 1


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValidationError, match="min_tokens must be <= max_tokens, got min_tokens=20 > max_tokens=16"):
        SamplingParams(min_tokens=20)


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(RequestError) as info:
        SamplingParams.from_any({"temprature": 0.5})
    assert "temprature: unknown field" in info.value.message
    assert info.value.param == "temprature"


def test_assignment_is_validated():
    params = SamplingParams()
    with pytest.raises(ValidationError, match="top_p must be in"):
        params.top_p = 2.0


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids, p.bad_words) == ([], [], [])
    # this project's fields: None = the deployment's default K and mode
    assert (p.num_speculative_tokens, p.target_probs, p.drafter_invariant) == (None, "processed", None)


def test_normalisations_follow_vllm():
    p = SamplingParams(stop="END", stop_token_ids=[7, 7, 3], temperature=0.001, logit_bias={"12": -500, 4: 3.5})
    assert p.stop == ["END"]
    assert p.stop_token_ids == [7, 3]
    assert p.temperature == 0.01  # vLLM raises tiny temperatures to 0.01
    assert p.logit_bias == {12: -100.0, 4: 3.5}  # string keys (JSON), clamped to [-100, 100]
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_json_round_trip():
    p = SamplingParams(
        temperature=0.6, top_p=0.9, top_k=40, logit_bias={5: -2.0}, allowed_token_ids=[1, 2, 5],
        bad_words=["foo"], seed=123, stop=["\n\n"], logprobs=3, num_speculative_tokens=4,
        target_probs="raw", drafter_invariant=True,
    )
    text = p.model_dump_json()
    assert '"5":-2.0' in text  # JSON object keys are strings
    assert SamplingParams.model_validate_json(text) == p
    assert SamplingParams.from_any(p.model_dump(mode="json")) == p


def test_from_any_none_dict_and_instance():
    assert SamplingParams.from_any(None) == SamplingParams()
    assert SamplingParams.from_any({"temperature": 0.3}).temperature == 0.3
    p = SamplingParams(top_k=5)
    assert SamplingParams.from_any(p) is p
    with pytest.raises(RequestError, match="got int"):
        SamplingParams.from_any(3)


def test_from_any_collects_every_error():
    with pytest.raises(RequestError) as info:
        SamplingParams.from_any({"top_p": 2, "max_tokens": 0})
    assert "top_p: top_p must be in (0, 1]" in info.value.message
    assert "max_tokens: max_tokens must be at least 1" in info.value.message
    assert info.value.param == "top_p"
    assert isinstance(info.value, ValueError)


def _fake_vllm_params(**overrides):
    """An object shaped like vllm.SamplingParams after its __post_init__ (None lists, extra
    attributes this service ignores)."""
    attrs = dict(
        n=1, presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, temperature=0.7,
        top_p=0.9, top_k=-1, min_p=0.05, seed=7, stop=["</s>"], stop_token_ids=None, bad_words=None,
        ignore_eos=True, max_tokens=64, min_tokens=2, logprobs=None, prompt_logprobs=None,
        include_stop_str_in_output=False, logit_bias={3: 1.5}, allowed_token_ids=None,
        detokenize=True, skip_special_tokens=True, structured_outputs=None, extra_args=None,
        output_kind=0,
    )
    attrs.update(overrides)
    return SimpleNamespace(**attrs)


def test_from_vllm_like_object_reads_attributes():
    p = SamplingParams.from_any(_fake_vllm_params())
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, -1, 0.05, 7)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.1, 0.2)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias) == (["</s>"], [], [], {3: 1.5})
    assert (p.ignore_eos, p.max_tokens, p.min_tokens) == (True, 64, 2)
    assert p.target_probs == "processed"  # project fields keep their defaults


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(prompt_logprobs=1), "vllm.SamplingParams.prompt_logprobs=1 is not supported"),
        (dict(structured_outputs=object()), "structured_outputs"),
        (dict(n=3), "n must be 1, got 3"),
        (dict(max_tokens=None), "max_tokens"),
    ],
)
def test_from_vllm_like_object_refuses_what_it_cannot_honour(overrides, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams.from_any(_fake_vllm_params(**overrides))


def test_draw_seed_is_a_63_bit_seed():
    seeds = {draw_seed() for _ in range(50)}
    assert len(seeds) == 50
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**40  # really random bits, not a small counter
    SamplingParams(seed=max(seeds))  # accepted as a request seed
