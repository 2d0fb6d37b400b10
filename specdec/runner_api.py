"""`Runner`: what a round needs from a model, whichever runs it.

`specdec.runner.ModelRunner` (one device), `deployments.tensor_parallel.TensorParallelRunner`
(ranks over several devices) and wrappers such as the benchmark's timed runner all have this
shape; `specdec.rounds.run_draft` / `run_target` and `specdec.lockstep` take any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

# (request_id, token_ids, num_logits): afterwards the runner's cache for request_id holds
# exactly token_ids, and the call returns float32 logits [num_logits, vocab_size] for its
# last num_logits positions.
ExtendItem = tuple[str, Sequence[int], int]


@runtime_checkable
class Runner(Protocol):
    vocab_size: int
    max_context: int

    def extend(self, items: Sequence[ExtendItem]) -> list[torch.Tensor]: ...

    def release(self, request_id: str) -> None: ...

    def cache_usage(self) -> dict: ...

    def calibration(self) -> dict: ...
