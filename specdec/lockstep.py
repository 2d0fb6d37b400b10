"""The in-process driver: many requests advance in lockstep, one batched round per step.

`run` is the one loop that `specdec.local.LocalEngine.generate` and the benchmark's
in-process backend (benchmarks/backends.py) share: call `engine.step` on the unfinished
requests until none is left, then drop their caches on both runners.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from specdec.generation import Generation
from specdec.runner_api import Runner


class Engine(Protocol):
    """What the loop needs: one batched round, and the two runners' caches to release."""

    draft: Runner
    target: Runner

    def step(self, gens: Sequence[Generation]) -> None: ...


def run(
    engine: Engine,
    gens: Sequence[Generation],
    on_step: Callable[[float], None] | None = None,
) -> None:
    """Run `gens` to completion; `on_step(seconds)` after each step (its duration)."""
    active = list(gens)
    try:
        while active:
            started = time.perf_counter()
            engine.step(active)
            if on_step is not None:
                on_step(time.perf_counter() - started)
            active = [g for g in active if not g.finished]
    finally:
        for g in gens:
            engine.draft.release(g.request_id)
            engine.target.release(g.request_id)
