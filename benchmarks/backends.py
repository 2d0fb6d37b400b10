"""Where the benchmark's requests run: the in-process engine (default) or a running app.

Both backends take the same request dicts (``GenerateRequest`` fields) and return the same
`Output` records and `RunStats`. The in-process backend is `specdec.local.LocalEngine`, driven
by the same loop as its `generate` (`specdec.lockstep.run`); its `step` is exactly one batched round of the Draft and Target deployments, so speculative and
target-only decoding run on the same engine; concurrency there is the engine's batch size
(requests in lockstep). It also measures what only an in-process run can see: forward passes
and their time per model, and Σₓ min(p(x), q(x)) at every scored proposal.

Longer than 300 lines because both backends share the `Output` / `RunStats` records
they fill, and the in-process one its measurement helpers (round log, timed runner).
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdec import lockstep
from specdec.api_types import GenerateRequest
from specdec.generation import Generation, RoundResult
from specdec.packing import unpack_probs


@dataclass
class Output:
    """One finished request, as the benchmark needs it."""

    num_tokens: int
    text: str
    seed: int
    speculation: dict  # rounds, proposed, accepted, emitted, acceptance_rate, system_efficiency
    token_ids: list[int] | None = None  # in-process only
    pieces: list[str] | None = None  # token texts (when asked for)
    first_probs: dict[str, float] | None = None  # processed p over the top tokens at position 0


@dataclass
class RoundLog:
    """Per-round counters of speculative rounds (k > 0), in-process only."""

    rounds: int = 0  # rounds that proposed at least one token
    proposed: int = 0
    accepted: int = 0
    tested: int = 0  # proposals whose acceptance test decided something (<= first rejection)
    full: int = 0  # rounds where every proposal was accepted
    overlap_tested: float = 0.0  # sum of min(p, q) mass over tested proposals
    overlap_var: float = 0.0  # sum of o (1 - o) over tested proposals
    overlap_all: float = 0.0  # sum over every scored proposal
    overlap_n: int = 0  # scored proposals with an overlap value
    overlap_tested_n: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count by proposal index
    tested_at: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int, overlaps: list[float] | None) -> None:
        tested = min(accepted + 1, k)
        self.rounds += 1
        self.proposed += k
        self.accepted += accepted
        self.tested += tested
        self.full += accepted == k
        while len(self.tested_at) < k:
            self.tested_at.append(0)
            self.accepted_at.append(0)
        for i in range(tested):
            self.tested_at[i] += 1
            self.accepted_at[i] += i < accepted
        if overlaps is not None:
            self.overlap_all += sum(overlaps)
            self.overlap_n += len(overlaps)
            o = overlaps[:tested]
            self.overlap_tested += sum(o)
            self.overlap_var += sum(x * (1.0 - x) for x in o)
            self.overlap_tested_n += len(o)

    def merge(self, other: "RoundLog") -> None:
        for name in ("rounds", "proposed", "accepted", "tested", "full", "overlap_tested",
                     "overlap_var", "overlap_all", "overlap_n", "overlap_tested_n"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, (a, t) in enumerate(zip(other.accepted_at, other.tested_at)):
            while len(self.tested_at) <= i:
                self.tested_at.append(0)
                self.accepted_at.append(0)
            self.accepted_at[i] += a
            self.tested_at[i] += t


@dataclass
class RunStats:
    """What one batch of requests cost."""

    wall_s: float = 0.0  # total, excluding the benchmark's own measurement work
    first_step_s: float = 0.0  # the first round of each batch (includes the prefills)
    first_step_tokens: int = 0
    draft_forward_s: float = 0.0
    target_forward_s: float = 0.0
    draft_passes: int = 0
    target_passes: int = 0
    draft_tokens_fed: int = 0
    target_tokens_fed: int = 0
    step_s: float = 0.0  # time inside engine.step (forwards + processing + rejection)
    rounds: int = 0  # engine steps (batched rounds)
    measure_s: float = 0.0  # the benchmark's Σ min(p, q) work, subtracted from the above
    log: RoundLog | None = None


class _Recorder:
    def __init__(self) -> None:
        self.log = RoundLog()
        self.seconds = 0.0
        self.lock = threading.Lock()


class MeasuredGeneration(Generation):
    """A Generation that also records Σₓ min(p(x), q(x)) at each scored proposal.

    Generation.accept is unchanged; the overlap is computed from the same packed p and q
    before it (the time taken is recorded so that it can be left out of throughput)."""

    recorder: _Recorder | None = None

    def accept(self, proposal, scores) -> RoundResult:
        rec = self.recorder
        k = len(proposal.tokens)
        overlaps = None
        if rec is not None and k and proposal.probs is not None:
            t0 = time.perf_counter()
            p = unpack_probs(scores.probs)[:k]
            q = unpack_probs(proposal.probs)
            overlaps = torch.minimum(p, q).sum(dim=1).tolist()
            rec.seconds += time.perf_counter() - t0
        out = super().accept(proposal, scores)
        if rec is not None and k:
            rec.log.add(k, out.accepted, overlaps)
        return out


class _TimedRunner:
    """Wraps a ModelRunner: counts forward passes, tokens fed and time spent in them."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.seconds = 0.0
        self.passes = 0
        self.tokens = 0

    def extend(self, items):
        t0 = time.perf_counter()
        out = self.runner.extend(items)
        self.seconds += time.perf_counter() - t0
        self.passes += 1
        self.tokens += sum(len(t) for _, t, _ in items)  # an upper bound: cached prefixes are reused
        return out

    def __getattr__(self, name):
        return getattr(self.runner, name)


class _StepAccount:
    """`on_step` of one lockstep batch: step time and count, the first step (prefills),
    progress in tokens."""

    def __init__(self, stats: RunStats, gens, progress: Callable[[int], None] | None) -> None:
        self.stats, self.gens, self.progress = stats, gens, progress
        self.first, self.done = True, 0

    def __call__(self, seconds: float) -> None:
        self.stats.step_s += seconds
        self.stats.rounds += 1
        made = sum(len(g.output) for g in self.gens)
        if self.first:
            self.stats.first_step_s += seconds
            self.stats.first_step_tokens += made
            self.first = False
        if self.progress is not None:
            self.progress(made - self.done)
        self.done = made


def _first_probs(result) -> dict[str, float] | None:
    if not result.logprobs:
        return None
    return {text: math.exp(lp) for _, text, lp in result.logprobs[0].top_logprobs}


class LocalBackend:
    """The in-process engine (specdec.local.LocalEngine)."""

    kind = "in-process"

    def __init__(self, draft_dir, target_dir, *, dtype: str = "bfloat16", **engine_args) -> None:
        from specdec.local import LocalEngine

        self.engine = LocalEngine(draft_dir, target_dir, dtype=dtype, **engine_args)
        self.draft = self.engine.draft = _TimedRunner(self.engine.draft)
        self.target = self.engine.target = _TimedRunner(self.engine.target)
        self.tokenizer = self.engine.info.tokenizer
        self.draft_bytes = self.draft.runner.model.weight_bytes()
        self.target_bytes = self.target.runner.model.weight_bytes()
        self.describe = {
            "backend": self.kind, "draft": str(draft_dir), "target": str(target_dir),
            "dtype": dtype, "torch_threads": torch.get_num_threads(),
            "formats": [self.draft.runner.model.format, self.target.runner.model.format],
            "draft_weight_bytes": self.draft_bytes, "target_weight_bytes": self.target_bytes,
        }

    def run(self, requests: Sequence[dict], concurrency: int, *, pieces: bool = False,
            progress: Callable[[int], None] | None = None) -> tuple[list[Output], RunStats]:
        eng, stats, rec = self.engine, RunStats(), _Recorder()
        d0 = (self.draft.seconds, self.draft.passes, self.draft.tokens)
        t0 = (self.target.seconds, self.target.passes, self.target.tokens)
        outputs: list[Output] = []
        start = time.perf_counter()
        for lo in range(0, len(requests), concurrency):
            chunk = requests[lo : lo + concurrency]
            gens = [MeasuredGeneration.admit(GenerateRequest.model_validate(r), eng.info)
                    for r in chunk]
            for g in gens:
                g.recorder = rec
            lockstep.run(eng, gens, _StepAccount(stats, gens, progress))
            for g in gens:
                r = g.result()
                outputs.append(Output(
                    num_tokens=len(r.token_ids), text=r.text, seed=r.seed,
                    speculation=r.speculation.model_dump(), token_ids=list(r.token_ids),
                    pieces=[self.tokenizer.decode([t]) for t in r.token_ids] if pieces else None,
                    first_probs=_first_probs(r)))
        stats.measure_s = rec.seconds
        stats.wall_s = time.perf_counter() - start - rec.seconds
        stats.step_s -= rec.seconds
        stats.draft_forward_s = self.draft.seconds - d0[0]
        stats.draft_passes = self.draft.passes - d0[1]
        stats.draft_tokens_fed = self.draft.tokens - d0[2]
        stats.target_forward_s = self.target.seconds - t0[0]
        stats.target_passes = self.target.passes - t0[1]
        stats.target_tokens_fed = self.target.tokens - t0[2]
        stats.log = rec.log
        return outputs, stats

    def close(self) -> None:
        self.engine = self.draft = self.target = None


class HttpBackend:
    """A running app's OpenAI-compatible API (POST /v1/completions with token-id prompts).

    Concurrency is the number of requests in flight; the server batches them as it does.
    Only aggregate speculation counters come back, so Σ min(p, q), forward passes and the
    per-token acceptance (which is solved from the mean accepted per round) are limited."""

    kind = "http"

    def __init__(self, url: str, tokenizer, *, api_key: str | None = None,
                 timeout_s: float = 3600.0) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.draft_bytes = self.target_bytes = None
        models = self._get("/v1/models")
        self.model = models["data"][0]["id"] if models.get("data") else None
        self.describe = {"backend": self.kind, "url": self.url, "model": self.model}

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self._headers())
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def _body(self, request: dict, pieces: bool) -> dict:
        sp = dict(request.get("sampling_params") or {})
        body = {"prompt": list(request["prompt_token_ids"]), "model": self.model}
        # Sampling fields keep their names over HTTP (both come from SamplingParams); only
        # logprobs differs: a number of alternatives on /v1/completions, set below.
        body.update({k: v for k, v in sp.items() if v is not None and k != "logprobs"})
        if sp.get("logprobs") is not None or pieces:
            body["logprobs"] = sp.get("logprobs") or 0
        return body

    def _one(self, request: dict, pieces: bool) -> Output:
        resp = self._post("/v1/completions", self._body(request, pieces))
        choice = resp["choices"][0]
        lp = choice.get("logprobs") or {}
        first = None
        if lp.get("top_logprobs") and (request.get("sampling_params") or {}).get("logprobs"):
            first = {t: math.exp(v) for t, v in lp["top_logprobs"][0].items()}
        return Output(num_tokens=resp["usage"]["completion_tokens"], text=choice["text"],
                      seed=resp["seed"], speculation=resp["speculation"],
                      pieces=list(lp["tokens"]) if pieces and lp.get("tokens") else None,
                      first_probs=first)

    def run(self, requests: Sequence[dict], concurrency: int, *, pieces: bool = False,
            progress: Callable[[int], None] | None = None) -> tuple[list[Output], RunStats]:
        stats = RunStats()
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [pool.submit(self._one, r, pieces) for r in requests]
            outputs = []
            for f in futures:
                out = f.result()
                outputs.append(out)
                if progress is not None:
                    progress(out.num_tokens)
        stats.wall_s = time.perf_counter() - start
        stats.rounds = sum(o.speculation.get("rounds") or 0 for o in outputs)
        return outputs, stats

    def close(self) -> None:
        pass
