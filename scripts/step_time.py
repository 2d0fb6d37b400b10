"""Whole-pass step times of the default pair as the shipped configuration loads it, for each
attention implementation: the draft's one-row decode and the target's 4-row verify (K = 3),
median over 25 calls after a 200-token prompt. Each implementation runs in its own process
(the choice is made once per process).

    .venv/bin/python scripts/step_time.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

PROMPT, CALLS, WARMUP = 200, 25, 5


def step_ms(model_dir, *, draft: bool, rows: int) -> tuple[float, dict]:
    from specdec.runner import ModelRunner

    runner = ModelRunner(model_dir, dtype="auto", batch_invariant=True, draft=draft,
                         proposal_vocab=65536 if draft else None)
    ids = [(17 * i) % 30000 + 100 for i in range(PROMPT + rows * (CALLS + WARMUP))]
    runner.extend([("r", ids[:PROMPT], 1)])
    times = []
    for i in range(1, CALLS + WARMUP + 1):
        start = time.perf_counter()
        runner.extend([("r", ids[: PROMPT + rows * i], rows)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:]) * 1e3, runner.calibration()


def measure() -> None:
    from specdec.model_pair import ensure_default_pair

    draft_dir, target_dir = ensure_default_pair()
    for name, path, draft, rows in (("draft 1-row decode", draft_dir, True, 1),
                                    ("target 4-row verify", target_dir, False, 4)):
        ms, cal = step_ms(path, draft=draft, rows=rows)
        print(f"{cal['attention']:>6} attention, {name}: {ms:.1f} ms ({cal['format']})", flush=True)


if __name__ == "__main__":
    if "--one" in sys.argv:
        measure()
    else:
        for impl in ("auto", "torch"):
            subprocess.run([sys.executable, __file__, "--one"], check=True,
                           env=dict(os.environ, SPECDEC_ATTENTION=impl))
