"""The Coordinator deployment: owns every request and runs its draft -> score -> accept
rounds against the Draft and Target pools. It is also the HTTP ingress (OpenAI API).

All request state (prompt, committed tokens, parameters, effective seed) lives here; the
pools hold only caches. A failed draft call is retried on another replica and, failing
that, the round runs target-only; a failed target call is retried (the replica that
answers re-prefills from the token list it is sent). Randomness is keyed by (seed,
position, purpose) and every call carries its full token list, so a retried call computes
what the lost one would have (given the same logits: `batch_invariant`): retries do not
change a seeded text. The target-only fallback does, in standard mode: a round without
proposals samples its token by Gumbel-max, a round with proposals by the accept / residual
rule, so the text may differ (it is still an exact sample of the target). A
drafter-invariant request's text is the same with or without its draft (it falls back at
once), so neither retries nor the fallback change it. README: "What a seed guarantees".
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from pathlib import Path
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from deployments.config import AppConfig
from deployments.http import make_app
from deployments.metrics import CoordinatorMetrics
from specdec.api_types import GenerateDelta, GenerateRequest, GenerateResult
from specdec.errors import RequestError
from specdec.k_policy import Costs
from specdec.generation import Generation, ModelInfo, RoundResult, RoundTimes, generate_stream
from specdec.models import check_same_tokenizer, resolve_model
from specdec.params import SamplingParams
from specdec.vocab import eos_token_ids
from specdec.rounds import DraftCall, Proposal, ScoreCall, Scores

logger = logging.getLogger("ray.serve")

# Errors that mean "that replica is gone or going", worth a retry elsewhere.
REPLICA_LOST = (RayActorError, ActorUnavailableError)


# A replaced replica (redeploy, downscale) keeps serving its open streams until they end:
# a long generation on a CPU takes minutes, far past Serve's 20 s default.
# The HTTP app is built per replica, around the replica itself (`__serve_build_asgi_app__`,
# called by Serve after __init__): no module-level app and no shared state.
@serve.deployment(name="Coordinator", graceful_shutdown_timeout_s=300)
@serve.ingress()
class Coordinator:
    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, config: dict):
        self.config = AppConfig.model_validate(config)
        self.draft, self.target = draft, target
        draft_dir, target_dir = (
            resolve_model(pool.model, cache_dir=self.config.cache_dir, weights=False)
            for pool in (self.config.draft, self.config.target)
        )
        check_same_tokenizer(draft_dir, target_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model_name = self.config.served_model_name
        self.metrics = CoordinatorMetrics(model=self.config.served_model_name)
        self.info = ModelInfo(
            tokenizer=self.tokenizer,
            # The smaller of the two models bounds the vocabulary and the context.
            vocab_size=min(_config(d)["vocab_size"] for d in (draft_dir, target_dir)),
            max_context=min(_config(d)["max_position_embeddings"] for d in (draft_dir, target_dir)),
            eos_token_ids=eos_token_ids(target_dir, self.tokenizer),
            default_num_speculative_tokens=self.config.num_speculative_tokens,
            default_drafter_invariant=self.config.drafter_invariant,
        )
        self.max_context = self.info.max_context
        self._k_costs_lock = asyncio.Lock()
        self._k_costs_loaded = False
        # requests in rounds on this replica, by id: the load adaptive K may weigh
        self._in_rounds: dict[int, Generation] = {}

    def __serve_build_asgi_app__(self):
        return make_app(self)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as error:  # template errors are the caller's messages' fault
            raise RequestError(f"messages could not be formatted: {error}", param="messages")
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # ---- the Python handle API ----------------------------------------------------------

    async def generate(self, request, sampling_params=None) -> GenerateResult:
        """`request`: a GenerateRequest, a dict of its fields, a prompt string, or a list of
        token ids; `sampling_params`: a SamplingParams, a dict, or a vllm.SamplingParams."""
        gen = await self._admit(request, sampling_params)
        async for _ in self._rounds(gen):
            pass
        return gen.result()

    async def generate_stream(self, request, sampling_params=None) -> AsyncIterator[GenerateDelta]:
        """Streamed variant: call through `handle.options(stream=True)`."""
        gen = await self._admit(request, sampling_params)
        async for delta in self._rounds(gen):
            yield delta

    # ---- internals ----------------------------------------------------------------------

    async def _admit(self, request, sampling_params) -> Generation:
        if self.config.adaptive_k and not self._k_costs_loaded:
            await self._load_k_costs()
        return Generation.admit(_as_request(request, sampling_params), self.info)

    async def _load_k_costs(self) -> None:
        """Once per replica, before the first request: the cost table adaptive K uses, from
        the config or else from the pools' load-time calibrations (which a node caches, so
        every replica on it reads the same table). Fixed from then on: a request's K
        sequence depends on its own acceptance only."""
        async with self._k_costs_lock:
            if self._k_costs_loaded:
                return
            if self.config.k_costs:
                costs = Costs(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in self.config.k_costs.items()})
            else:
                # A pool answers a call only once it has loaded. Both must have: a pool
                # that times its passes while the other loads beside it on the same cores
                # prices them several times too high (a one-row target pass timed at
                # 1081 ms instead of ~150 when the first request came early).
                await asyncio.gather(self.draft.cache_usage.remote(),
                                     self.target.cache_usage.remote())
                draft, target = await asyncio.gather(self.draft.calibration.remote(),
                                                     self.target.calibration.remote())
                costs = Costs.from_calibrations(draft, target)
            logger.info("adaptive K up to %d with costs %s", self.config.num_speculative_tokens,
                        costs.to_dict() if costs else "none measured: K stays as configured")
            self.info.k_costs, self._k_costs_loaded = costs, True

    async def _rounds(self, gen: Generation) -> AsyncIterator[GenerateDelta]:
        started = time.perf_counter()
        first_token_s = None
        self.metrics.in_flight(+1)
        self._in_rounds[id(gen)] = gen
        try:
            async for delta in generate_stream(gen, self._propose, self._score, self._on_round,
                                               in_rounds=self._in_rounds.values()):
                if first_token_s is None and delta.token_ids:
                    first_token_s = time.perf_counter() - started
                    self.metrics.first_token(first_token_s)
                yield delta
            self.metrics.finished(
                gen.stats.to_dict(), time.perf_counter() - started, len(gen.output),
                ttft_s=first_token_s, finish_reason=gen.finish_reason,
            )
        finally:
            self.metrics.in_flight(-1)
            del self._in_rounds[id(gen)]
            # Fire and forget: a cancelled request must not wait on cleanup. A release is a
            # call like any other for autoscaling, so a pool that never saw it is spared.
            # Sent from an empty context: inside the request's own, Serve would count the
            # releases as its child calls and cancel them with a cancelled request.
            release = contextvars.Context().run
            if gen.used_draft:
                release(self.draft.release.remote, gen.request_id)
            release(self.target.release.remote, gen.request_id)

    def _on_round(self, gen: Generation, times: RoundTimes, outcome: RoundResult) -> None:
        self.metrics.round(
            times.draft_s, times.target_s, times.coordinator_s,
            outcome.proposed, outcome.accepted, len(outcome.tokens),
        )

    async def _propose(self, call: DraftCall) -> Proposal:
        patience = 0.0 if call.sampling.params.drafter_invariant else self.config.draft_retry_timeout_s
        try:
            return await self._with_retries(self.draft.propose, call, patience)
        except REPLICA_LOST:
            logger.warning("no draft replica answered; request %s runs target-only", call.request_id)
            return Proposal(tokens=[], probs=None)

    async def _score(self, call: ScoreCall) -> Scores:
        return await self._with_retries(self.target.score, call, self.config.target_retry_timeout_s)

    async def _with_retries(self, method, call, patience_s: float):
        """Call until a replica answers; the replica that does re-prefills if it must."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return await method.remote(call)
            except REPLICA_LOST as error:
                if time.monotonic() + self.config.retry_backoff_s > deadline:
                    raise
                logger.warning("%s lost a replica, retrying: %s", method, error)
                await asyncio.sleep(self.config.retry_backoff_s)


def _as_request(request, sampling_params) -> GenerateRequest:
    if isinstance(request, GenerateRequest):
        request = request.model_dump(exclude={"sampling_params"}) | {
            "sampling_params": request.sampling_params
        }
    elif isinstance(request, str):
        request = {"prompt": request}
    elif isinstance(request, (list, tuple)):
        request = {"prompt_token_ids": list(request)}
    request = dict(request)
    if sampling_params is not None:
        request["sampling_params"] = sampling_params
    if request.get("sampling_params") is not None:
        request["sampling_params"] = SamplingParams.from_any(request["sampling_params"])
    return GenerateRequest.model_validate(request)


def _config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
