"""Sampling parameters of one request: vLLM's field names and meanings (for one sequence),
plus this project's speculation fields.

Differences from ``vllm.SamplingParams`` are deliberate and few: ``n`` must be 1, ``logprobs``
is bounded to [0, 20] (no -1 = whole vocabulary), ``seed`` must be in [0, 2**63) because the
counter-based randomness keys on it as an int64, ``max_tokens`` cannot be None, and
``logit_bias`` keys may be strings (JSON objects, as in the OpenAI API).

Longer than 300 lines because it is one model: a validator per field, each with the
message that tells the caller what to change, and the vllm.SamplingParams adapter.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specdec.errors import RequestError

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # vLLM raises smaller positive temperatures to this (_MAX_TEMP)
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # K when neither the request nor the deployment sets it
MAX_LOGIT_BIAS = 100.0  # vLLM and OpenAI clamp biases to [-100, 100]
SEED_LIMIT = 2**63
# Validation context key: refuse a logit bias outside [-100, 100] (OpenAI's HTTP API does)
# instead of clamping it (vLLM's Python API does). The HTTP layer validates with it set:
#     SamplingParams.model_validate(data, context={REFUSE_OUT_OF_RANGE_BIAS: True})
REFUSE_OUT_OF_RANGE_BIAS = "refuse_out_of_range_bias"
# This project's fields; every other field is vLLM's, with vLLM's name and meaning.
PROJECT_FIELDS = ("num_speculative_tokens", "target_probs", "drafter_invariant")


class SamplingParams(BaseModel):
    """How to turn a model's logits into the distribution a request samples from.

    Everything that changes the distribution is applied identically to the draft and the
    target (see ``specdec.processing``), so speculative decoding stays exact.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- vLLM fields --------------------------------------------------------------------
    # The descriptions are also the HTTP API's (deployments/http/schemas.py derives its
    # sampling fields from this model): keep them short, with the allowed range.
    n: int = Field(1, description="Must be 1.")
    temperature: float = Field(1.0, description="[0, 2]; 0 = greedy. Default 1.")
    top_k: int = Field(0, description="0 or -1 = off, else >= 1.")
    top_p: float = Field(1.0, description="(0, 1]; 1 = off.")
    min_p: float = Field(0.0, description="[0, 1]; 0 = off.")
    repetition_penalty: float = Field(1.0, description="> 0; 1 = off.")
    presence_penalty: float = Field(0.0, description="[-2, 2].")
    frequency_penalty: float = Field(0.0, description="[-2, 2].")
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    allowed_token_ids: list[int] | None = Field(None, description="Non-empty when set.")
    bad_words: list[str] = []
    seed: int | None = Field(None, description="[0, 2**63); omitted = drawn and returned.")
    max_tokens: int = Field(16, description=">= 1.")
    min_tokens: int = Field(0, description=">= 0 and <= max_tokens.")
    stop: list[str] = Field([], description="A string or a list of strings.")
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, description="Top alternatives per token, [0, 20].")

    # --- this project's fields (PROJECT_FIELDS) -------------------------------------------
    num_speculative_tokens: int | None = Field(
        None, description="Draft tokens per round, [0, 16]; 0 = target only."
    )
    """Draft tokens per round: None = the deployment's default, 0 = target only."""
    target_probs: Literal["processed", "raw"] = Field(
        "processed", description='"processed" (correct, default) or "raw" (benchmark only).'
    )
    """"processed" (correct): the target distribution gets this request's parameters, like
    the draft's. "raw" is INCORRECT on purpose: the target is scored with plain
    softmax(logits) (temperature 1, no top-k/top-p/penalties), as vLLM did before PR 10198;
    the output distribution is then wrong. Kept only so the benchmark can measure it."""
    drafter_invariant: bool | None = Field(
        None, description="Gumbel-max coupling: same seeded text for any draft and K. "
        "Omitted: the deployment's default (true in the shipped configs)."
    )
    """Gumbel-max coupling: a seeded request gives the same text for any draft model and K,
    equal to target-only sampling with that seed; false: standard rejection sampling, whose
    text also depends on the K sequence and the draft. None: the deployment's default
    (admission fixes it, `specdec.admission`)."""

    @property
    def gumbel_coupled(self) -> bool:
        """Whether this request samples in drafter-invariant mode; unset counts as standard
        (admission replaces it by the deployment's default before any round)."""
        return bool(self.drafter_invariant)

    # --- validation ---------------------------------------------------------------------
    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                f"n must be 1, got {v}: this service returns one sequence per request; "
                "send n separate requests (with different seeds) instead"
            )
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not 0.0 <= v <= MAX_TEMPERATURE:  # also refuses NaN
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {v}"
            )
        if GREEDY_EPS <= v < MIN_TEMPERATURE:
            return MIN_TEMPERATURE  # as vLLM: tiny temperatures overflow in half precision
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _openai_penalty(cls, v: float, info) -> float:
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{info.field_name} must be in [-2, 2] (0 = off), got {v}")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_keys(cls, v: Any) -> Any:
        # JSON object keys are strings ("50256": -100), as in the OpenAI API.
        if isinstance(v, dict):
            out = {}
            for key, bias in v.items():
                try:
                    out[int(key)] = bias
                except (TypeError, ValueError):
                    raise ValueError(
                        f"logit_bias keys must be token ids (integers), got {key!r}"
                    ) from None
            return out
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None, info: ValidationInfo) -> dict[int, float] | None:
        if v is None:
            return None
        refuse = bool((info.context or {}).get(REFUSE_OUT_OF_RANGE_BIAS))
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            if math.isnan(bias):
                raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got NaN")
            if refuse and abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        # vLLM's Python API clamps; OpenAI's HTTP API refuses (see REFUSE_OUT_OF_RANGE_BIAS).
        return {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)) for t, b in v.items()}

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError(
                "allowed_token_ids must not be empty; omit it (null) to allow every token"
            )
        _non_negative_ids(v, "allowed_token_ids")
        return list(dict.fromkeys(v))

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        _non_negative_ids(v, "stop_token_ids")
        return list(dict.fromkeys(v))

    @field_validator("bad_words", "stop", mode="before")
    @classmethod
    def _str_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("bad_words", "stop")
    @classmethod
    def _no_empty_strings(cls, v: list[str], info) -> list[str]:
        if any(not s for s in v):
            raise ValueError(f"{info.field_name} must not contain an empty string, got {v!r}")
        return list(dict.fromkeys(v))

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63) or null (a seed is then drawn), got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"min_tokens must be at least 0, got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or null (none), got {v}")
        return v

    @field_validator("num_speculative_tokens")
    @classmethod
    def _num_speculative_tokens(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] "
                f"(0 = target only) or null (the deployment's default), got {v}"
            )
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"> max_tokens={self.max_tokens}"
            )
        return self

    # --- helpers ------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (tests/test_params.py checks the cut-off;
        processing.py applies the same GREEDY_EPS to a whole batch of rows at once)."""
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_any(cls, obj: Any) -> "SamplingParams":
        """Build from None (defaults), a dict (e.g. parsed JSON), a SamplingParams, or a
        ``vllm.SamplingParams`` (its attributes are read; vllm is never imported here).

        Raises RequestError (a ValueError) whose message names every invalid field.
        """
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, dict):
            data = obj
        elif hasattr(obj, "temperature") and hasattr(obj, "top_p"):
            data = _from_vllm(obj)
        else:
            raise RequestError(
                "sampling_params must be an object (dict), a SamplingParams or a "
                f"vllm.SamplingParams, got {type(obj).__name__}",
                param="sampling_params",
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _request_error(exc) from None


def draw_seed() -> int:
    """An effective seed for a request that gave none: 63 random bits, so it fits an int64
    and the request can be reproduced by sending it back."""
    return secrets.randbits(63)


def _non_negative_ids(ids: list[int], name: str) -> None:
    bad = [t for t in ids if t < 0]
    if bad:
        raise ValueError(f"{name} must be token ids >= 0, got {bad[:5]}")


def _request_error(exc: ValidationError) -> RequestError:
    parts, first = [], None
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        first = first or field
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against the SamplingParams fields"
        parts.append(f"{field}: {msg}" if field else msg)
    return RequestError("invalid sampling_params: " + "; ".join(parts), param=first or None)


# vllm.SamplingParams attributes that change what is generated but that this service does
# not implement: refused when set, rather than silently ignored.
_VLLM_UNSUPPORTED = {
    "best_of": lambda v: v not in (None, 1),
    "prompt_logprobs": lambda v: v is not None,
    "logits_processors": bool,
    "structured_outputs": lambda v: v is not None,
    "guided_decoding": lambda v: v is not None,
    "truncate_prompt_tokens": lambda v: v is not None,
    "logprob_token_ids": lambda v: v is not None,
    "trace_decode_token_ids": lambda v: v is not None,
}
# Fields read from a vllm.SamplingParams: all but this project's own. A None there for a
# list field means "empty".
_VLLM_FIELDS = [name for name in SamplingParams.model_fields if name not in PROJECT_FIELDS]
_NONE_MEANS_EMPTY = {"bad_words", "stop", "stop_token_ids"}


def _from_vllm(obj: Any) -> dict[str, Any]:
    for name, is_set in _VLLM_UNSUPPORTED.items():
        value = getattr(obj, name, None)
        if is_set(value):
            raise RequestError(
                f"vllm.SamplingParams.{name}={value!r} is not supported by this service; "
                "leave it unset",
                param=name,
            )
    data: dict[str, Any] = {}
    for name in _VLLM_FIELDS:
        if not hasattr(obj, name):
            continue
        value = getattr(obj, name)
        if value is None and name in _NONE_MEANS_EMPTY:
            continue
        data[name] = value
    return data
