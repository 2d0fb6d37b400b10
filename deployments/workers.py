"""Draft and Target deployments: a model runner behind Ray Serve's dynamic batching.

Concurrent requests' calls are gathered by `@serve.batch` into one list, so their forward
passes are shared. The model runs on one worker thread, which keeps the replica's event
loop free (health checks, metrics, new calls queueing for the next batch) and serialises
every use of the runner's caches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from deployments.config import RunnerConfig
from deployments.tensor_parallel import TensorParallelRunner, default_threads
from specdec.models import resolve_model
from specdec.rounds import DraftCall, Proposal, ScoreCall, Scores, run_draft, run_target
from specdec.runner import ModelRunner

__all__ = ["Draft", "RunnerConfig", "Target"]

logger = logging.getLogger("ray.serve")


class _ModelServer:
    batched: str  # the name of the subclass's @serve.batch method

    def __init__(self, config: dict | RunnerConfig, cache_dir: str | None = None):
        self.config = RunnerConfig.model_validate(config)
        method = getattr(self, self.batched)  # @serve.batch sized from the config
        method.set_max_batch_size(self.config.max_batch_size)
        method.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)
        # Ray sets OMP_NUM_THREADS from the actor's num_cpus; a CPU replica left at one
        # thread decodes at half speed on a 2-core machine. Tensor-parallel ranks share.
        tp_size = self.config.tensor_parallel_size
        torch.set_num_threads(self.config.num_threads or default_threads(tp_size))
        path = resolve_model(self.config.model, cache_dir=cache_dir)
        if tp_size > 1:
            self.runner = TensorParallelRunner(path, self.config, tp_size)
        else:
            self.runner = ModelRunner(
                path,
                dtype=self.config.dtype,
                device=self.config.device,
                max_cache_tokens=self.config.max_cache_tokens,
                batch_invariant=self.config.batch_invariant,
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._released: OrderedDict[str, None] = OrderedDict()  # recently finished requests
        logger.info(
            "%s loaded %s on %s with %d threads",
            type(self).__name__, path, self.config.device, torch.get_num_threads(),
        )

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def release(self, request_id: str) -> None:
        """Drop a finished request's cache (best effort: LRU eviction covers the rest)."""
        self._released[request_id] = None
        while len(self._released) > 10_000:
            self._released.popitem(last=False)
        await self._run(self.runner.release, request_id)

    def _batch(self, fn, calls):
        """Run a batch on the model thread. A cancelled request's call can still be
        queued in a batch after its release arrived; drop what such calls cached."""
        results = fn(self.runner, calls)
        for call in calls:
            if call.request_id in self._released:
                self.runner.release(call.request_id)
        return results

    async def cache_usage(self) -> dict:
        return await self._run(self.runner.cache_usage)

    async def calibration(self) -> dict:
        """The weight format and matmul kernels measured at load (specdec.kernels)."""
        return self.runner.calibration()


@serve.deployment(name="Draft")
class Draft(_ModelServer):
    batched = "propose"

    @serve.batch
    async def propose(self, calls: list[DraftCall]) -> list[Proposal]:
        return await self._run(self._batch, run_draft, calls)


@serve.deployment(name="Target")
class Target(_ModelServer):
    batched = "score"

    @serve.batch
    async def score(self, calls: list[ScoreCall]) -> list[Scores]:
        return await self._run(self._batch, run_target, calls)
