"""Request and result types of the generation API, shared by the Python handle API and the
HTTP layer. Plain pydantic; no Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.params import SamplingParams


class GenerateRequest(BaseModel):
    """One generation: a prompt (text or token ids) and its sampling parameters."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'prompt_token_ids'")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' must not be empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """Per-request speculation counters (definitions: specdec.rejection.SpecStats)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    acceptance_rate: float | None = None  # accepted / proposed
    system_efficiency: float | None = None  # emitted / sum over rounds of (K + 1)


class TokenLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]] = []  # (token id, text, logprob), best first


class GenerateResult(BaseModel):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    usage: Usage
    seed: int  # the effective seed: pass it back to reproduce this output
    speculation: SpeculationStats
    logprobs: list[TokenLogprob] | None = None


class GenerateDelta(BaseModel):
    """One streamed piece. The last one has finish_reason set and carries usage, seed and
    speculation stats."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    seed: int | None = None
    speculation: SpeculationStats | None = None
