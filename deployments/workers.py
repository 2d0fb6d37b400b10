"""Draft and Target deployments: a model runner whose forward passes concurrent requests share.

Calls that arrive while a forward pass runs wait, and the next pass takes all of them
(`CallBatcher`), so under load a batch holds every waiting request: continuous batching.
(Ray Serve's `@serve.batch` closes a batch after its wait window even while the model is
busy, so with passes of hundreds of milliseconds its batches held one call each, measured.)
The model loads and runs on one worker thread, which keeps the replica's event loop free
(health checks, metrics, new calls queueing for the next batch) and serialises every use of
the runner's caches.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from deployments.config import RunnerConfig
from deployments.node_cores import NodeCores
from deployments.tensor_parallel import TensorParallelRunner, default_threads
from specdec.models import resolve_model
from specdec.pass_costs import with_pass_costs
from specdec.rounds import DraftCall, Proposal, ScoreCall, Scores, run_draft, run_target
from specdec.runner import ModelRunner

__all__ = ["Draft", "RunnerConfig", "Target"]

logger = logging.getLogger("ray.serve")


class CallBatcher:
    """Runs `run_batch(calls)` over every call that is waiting when the previous batch ends
    (at most max_batch_size); a call reaching an idle batcher with no callers in rounds (a
    new burst of requests) waits wait_s for company. Callers in rounds are waited for by
    regrouping instead, so a lone request in rounds waits for nobody (measured through the
    service on a 2-core Zen 5 EPYC: a target call's time in the replica beyond its pass fell
    from 2.6 to 0.5-0.7 ms, and eight requests batched as before: 1 + 7, then 8 every round).

    Requests in rounds come back together: each caller of a batch sends its next call once
    it has processed the result, a few milliseconds apart. The callers in rounds are those of
    the last batch plus those whose calls arrived while it ran; while fewer calls wait than
    that, the next batch waits for the rest, REGROUP of the last batch's time (at most
    REGROUP_MAX_S), renewed by each arrival up to twice that: the callers come back one
    after another, as the coordinator gets to each (eight requests through the service
    arrived over 20-35 ms, more than a quarter of the draft's 80 ms pass, and its batches
    split 2 + 6). Otherwise batches split into groups that alternate for good: two halves
    of eight requests (some drafted their first round, the others did not) alternated for
    126 passes, each costing about what one pass of all eight does.

    `cores_busy` (pools sharing a CPU node, deployments.node_cores): while another pool's
    pass holds the cores this batch could not run anyway, so waiting for the rest costs
    nothing and the window starts again once the cores are free. The callers still missing
    are then mostly in that other pass (the draft's, on their way here), and the pools
    alternate one batch of every request each, as the in-process engine does; measured
    without it: eight requests through the service split into three groups of 2-3 whose
    draft and target passes took turns."""

    REGROUP = 0.25
    REGROUP_MAX_S = 0.1  # after a long prefill batch, waiting a quarter of it would not pay
    POLL_S = 0.005  # how often a regrouping batch looks at the cores

    def __init__(self, run_batch, max_batch_size: int, wait_s: float,
                 cores_busy=lambda: False):
        self._run_batch, self._max, self._wait_s = run_batch, max_batch_size, wait_s
        self._cores_busy = cores_busy
        self._callers, self._last_s = 0, 0.0  # callers in rounds; the last batch's seconds
        self._arrivals = 0  # calls submitted so far
        self._waiting: list[tuple[object, asyncio.Future]] = []
        self._draining = False
        self._arrived = asyncio.Event()  # set by submit: a regrouping batch counts again
        self._task: asyncio.Task | None = None  # held: the loop keeps only weak references

    async def submit(self, call):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((call, future))
        self._arrivals += 1
        self._arrived.set()
        if not self._draining:
            self._draining = True
            # An empty context: the drain outlives the request that happened to start it.
            self._task = loop.create_task(self._drain(), context=contextvars.Context())
        return await future

    async def _drain(self) -> None:
        try:
            if not self._callers:
                await asyncio.sleep(self._wait_s)
            while self._waiting:
                await self._regroup()
                batch = [(c, f) for c, f in self._waiting[: self._max] if not f.done()]
                del self._waiting[: self._max]
                if batch:
                    await self._run(batch)
        except asyncio.CancelledError:  # the replica is going away: no caller waits forever
            for _, f in self._waiting:
                f.cancel()
            self._waiting.clear()
            raise
        finally:
            self._draining = False

    async def _regroup(self) -> None:
        window = min(self.REGROUP * self._last_s, self.REGROUP_MAX_S)
        deadline = time.monotonic() + window
        latest = deadline + window
        while len(self._waiting) < min(self._callers, self._max):
            now = time.monotonic()
            if self._cores_busy():
                deadline, latest = max(deadline, now + window), max(latest, now + 2 * window)
            left = deadline - now
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(left, self.POLL_S))
            except asyncio.TimeoutError:
                continue
            # a caller came: the rest are on their way, so wait on a while
            deadline = max(deadline, min(time.monotonic() + window, latest))

    async def _run(self, batch) -> None:
        started, arrivals = time.monotonic(), self._arrivals
        try:
            results = await self._run_batch([c for c, _ in batch])
            self._callers = len(batch) + self._arrivals - arrivals
            self._last_s = time.monotonic() - started
        except Exception as exc:  # every caller of the batch gets the error
            for _, f in batch:
                if not f.done():
                    f.set_exception(exc)
            return
        for (_, f), result in zip(batch, results):
            if not f.done():  # a cancelled caller's future is done already
                f.set_result(result)


class _ModelServer:
    round_fn = None  # run_draft or run_target: what one batch computes
    is_draft = False  # dtype auto may quantize a draft's activations (specdec.runner.auto_formats)

    def __init__(self, config: dict | RunnerConfig, cache_dir: str | None = None):
        self.config = RunnerConfig.model_validate(config)
        self._cores = NodeCores(self.config.takes_turns_on_cores())
        self._batcher = CallBatcher(self._run_batch, self.config.max_batch_size,
                                    self.config.batch_wait_timeout_s, self._cores.taken_by_another)
        # Every torch call of the replica runs on this one thread, loading and calibration
        # included: passes on another thread than the one that loaded the model took
        # 1.2-1.3x as long on a 2-core CPU (docs/serve_speed.md).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.runner = self._executor.submit(self._load, cache_dir).result()
        self._released: OrderedDict[str, None] = OrderedDict()  # recently finished requests
        self._pass_costs: dict | None = None  # calibration() with pass_ms, once timed

    def _load(self, cache_dir: str | None):
        # Ray sets OMP_NUM_THREADS from the actor's num_cpus; a CPU replica left at one
        # thread decodes at half speed on a 2-core machine. Tensor-parallel ranks share.
        tp_size = self.config.tensor_parallel_size
        torch.set_num_threads(self.config.num_threads or default_threads(tp_size))
        path = resolve_model(self.config.model, cache_dir=cache_dir)
        if tp_size > 1:
            runner = TensorParallelRunner(path, self.config, tp_size, draft=self.is_draft)
        else:
            runner = ModelRunner(
                path,
                dtype=self.config.dtype,
                device=self.config.device,
                max_cache_tokens=self.config.max_cache_tokens,
                batch_invariant=self.config.batch_invariant,
                proposal_vocab=self.config.proposal_vocab,
                draft=self.is_draft,
            )
        logger.info(
            "%s loaded %s on %s with %d threads%s",
            type(self).__name__, path, self.config.device, torch.get_num_threads(),
            ", taking turns on the node's cores" if self._cores.enabled else "",
        )
        return runner

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def release(self, request_id: str) -> None:
        """Drop a finished request's cache (best effort: LRU eviction covers the rest)."""
        self._released[request_id] = None
        while len(self._released) > 10_000:
            self._released.popitem(last=False)
        await self._run(self.runner.release, request_id)

    async def _run_batch(self, calls):
        return await self._run(self._batch, self.round_fn, calls)

    def _batch(self, fn, calls):
        """Run a batch on the model thread. A cancelled request's call can still be
        queued in a batch after its release arrived; drop what such calls cached."""
        with self._cores.turn():
            results = fn(self.runner, calls)
        for call in calls:
            if call.request_id in self._released:
                self.runner.release(call.request_id)
        return results

    async def cache_usage(self) -> dict:
        return await self._run(self.runner.cache_usage)

    async def calibration(self) -> dict:
        """The weight format and matmul kernels measured at load (specdec.kernels), and the
        whole passes' ms (specdec.pass_costs), timed on the first call: the coordinator's
        first request, once both pools have loaded and the cores are quiet."""
        return await self._run(self._calibration)

    def _calibration(self) -> dict:
        if self._pass_costs is None:
            with self._cores.turn():
                self._pass_costs = with_pass_costs(self.runner, draft=self.is_draft)
        return self._pass_costs


@serve.deployment(name="Draft")
class Draft(_ModelServer):
    round_fn = staticmethod(run_draft)
    is_draft = True

    async def propose(self, call: DraftCall) -> Proposal:
        return await self._batcher.submit(call)


@serve.deployment(name="Target")
class Target(_ModelServer):
    round_fn = staticmethod(run_target)

    async def score(self, call: ScoreCall) -> Scores:
        return await self._batcher.submit(call)
