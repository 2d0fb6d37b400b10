"""A model replica that spans several devices: tensor parallelism inside one Serve replica.

Rank 0 lives in the replica; ranks 1..N-1 are actors placed in the replica's own placement
group (bundle i holds rank i, so `STRICT_PACK` keeps a replica on one node). Every rank
holds a `ModelRunner` over its shard (heads and MLP columns / rows; KV cache by head) and
all of them run the same calls in the same order: each rank's cache decisions are a
function of the call sequence alone, so they stay in step, and the all-reduces inside the
forward line up. Callers see one runner: `TensorParallelRunner` has ModelRunner's interface.

NCCL on GPUs, gloo on CPU (which is how the tests run the same code path).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specdec.model import TensorParallel
from specdec.net import free_port
from specdec.runner import ModelRunner, resolve_format
from specdec.runner_api import ExtendItem, Runner


def _init_rank(init_method: str, rank: int, size: int, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)


def _runner(path, config, rank: int, size: int) -> ModelRunner:
    return ModelRunner(
        path,
        dtype=config.dtype,
        device=config.device,
        max_cache_tokens=config.max_cache_tokens,
        tp=TensorParallel(rank, size),
        batch_invariant=config.batch_invariant,
        proposal_vocab=config.proposal_vocab,
    )


@ray.remote
class TensorParallelWorker:
    """Rank 1..N-1 of a replica: runs what rank 0 runs, returns nothing."""

    def __init__(self, path: str, config, rank: int, size: int, init_method: str, threads: int):
        torch.set_num_threads(threads)
        _init_rank(init_method, rank, size, config.device)
        self.runner = _runner(path, config, rank, size)

    def ready(self) -> bool:
        return True

    def extend(self, items) -> None:
        self.runner.extend(items)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)


class TensorParallelRunner(Runner):
    """Rank 0 plus its workers, behind ModelRunner's interface (specdec.runner_api.Runner)."""

    def __init__(self, path, config, size: int, draft: bool = False):
        placement_group = ray.util.get_current_placement_group()
        if placement_group is None or len(placement_group.bundle_specs) < size:
            raise ValueError(
                f"tensor_parallel_size={size} needs a placement group of {size} bundles: set "
                "the deployment's placement_group_bundles (one per rank)"
            )
        # dtype auto: measured once here, so that every rank loads the same format
        fmt = resolve_format(path, config.dtype, config.device, config.batch_invariant, size,
                             config.proposal_vocab, draft)
        config = config.model_copy(update={"dtype": fmt})
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"
        threads = torch.get_num_threads()
        self.workers = [
            TensorParallelWorker.options(
                num_cpus=placement_group.bundle_specs[rank].get("CPU", 0),
                num_gpus=placement_group.bundle_specs[rank].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=rank
                ),
            ).remote(str(path), config, rank, size, init_method, threads)
            for rank in range(1, size)
        ]
        _init_rank(init_method, 0, size, config.device)  # returns once every rank joined
        self.local = _runner(path, config, 0, size)
        ray.get([w.ready.remote() for w in self.workers])
        self.vocab_size, self.max_context = self.local.vocab_size, self.local.max_context

    def extend(self, items: Sequence[ExtendItem]) -> list[torch.Tensor]:
        items = [(rid, list(tokens), n) for rid, tokens, n in items]
        pending = [w.extend.remote(items) for w in self.workers]
        try:
            return self.local.extend(items)
        finally:
            ray.get(pending)  # surfaces a worker's error; every rank raises the same one

    def release(self, request_id: str) -> None:
        pending = [w.release.remote(request_id) for w in self.workers]
        self.local.release(request_id)
        ray.get(pending)

    def cache_usage(self) -> dict:
        return self.local.cache_usage()

    def calibration(self) -> dict:
        return self.local.calibration()  # rank 0's; every rank calibrates its own shard


def default_threads(size: int) -> int:
    """Ranks on one CPU node share its cores."""
    return max(1, (os.cpu_count() or 1) // size)
