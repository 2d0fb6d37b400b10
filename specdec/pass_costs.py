"""Whole-pass costs, timed when a runner loads: what one round function (`run_draft` with
K=1, `run_target` with no proposals) takes at 1 and 16 decode rows, attention, sampling and
Python included, for a sampled request (T=0.6, top_p=0.9); and for a draft, what a prefill
costs per row (the catch-up before a request's first drafted round).

The cost table that adaptive K starts from (k_policy.Costs) prices matmuls only, and is
fixed for a deployment: standard-mode K depends on it. The rest of a pass is real: on a
2-core AMX Xeon a draft step took ~40 ms against a matmul estimate of 17, a one-row target
pass ~150 against 124, and the draft's prefill 1.7-1.8 ms a row against 0.9. So at eight
requests the table drafted where K=1 lost to K=0 (0.93x). Requests whose text cannot depend
on K (greedy, drafter-invariant) may weigh timing, so they add the measured remainder,
linear in rows (`Costs.draft_pass` / `target_pass` / `catch_up`).
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.params import SamplingParams
from specdec.processing import RequestSampling
from specdec.rounds import DraftCall, ScoreCall, run_draft, run_target

PASS_ROWS = (1, 16)
CONTEXT = 32  # tokens each timing sequence holds before its decode passes
PREFILL_ROWS = 64  # a draft's catch-up: a prompt's rows in one pass, none of them sampled
TIMED, WARMUP = 5, 1


def measure_pass_ms(runner, *, draft: bool, rows=PASS_ROWS) -> dict[int, float]:
    """Median ms of a decode pass of the round function at each row count."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(runner.vocab_size, 30000)
    sampling = RequestSampling(SamplingParams(temperature=0.6, top_p=0.9), ())
    out = {}
    for n in rows:
        ids = [f"pass-cost-{i}" for i in range(n)]
        tokens = torch.randint(100, vocab, (n, CONTEXT + TIMED + WARMUP), generator=generator).tolist()
        runner.extend([(i, t[:CONTEXT], 1) for i, t in zip(ids, tokens)])
        times = []
        try:
            for step in range(1, TIMED + WARMUP + 1):
                seqs = [t[: CONTEXT + step] for t in tokens]
                start = time.perf_counter()
                if draft:
                    run_draft(runner, [DraftCall(i, s, 1, sampling, 0) for i, s in zip(ids, seqs)])
                else:
                    run_target(runner, [ScoreCall(i, s, 0, sampling) for i, s in zip(ids, seqs)])
                times.append(time.perf_counter() - start)
        finally:
            for i in ids:
                runner.release(i)
        out[n] = round(statistics.median(times[WARMUP:]) * 1e3, 2)
    return out


def measure_prefill_row_ms(runner, rows: int = PREFILL_ROWS) -> float:
    """Median ms per row of a one-sequence prefill of `rows` tokens (the forward alone)."""
    tokens = torch.randint(100, min(runner.vocab_size, 30000), (rows,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    times = []
    for i in range(TIMED + WARMUP):
        start = time.perf_counter()
        runner.extend([(f"prefill-cost-{i}", tokens, 1)])
        times.append(time.perf_counter() - start)
        runner.release(f"prefill-cost-{i}")
    return round(statistics.median(times[WARMUP:]) * 1e3 / rows, 3)


def with_pass_costs(runner, *, draft: bool) -> dict:
    """`runner.calibration()` with `pass_ms` timed now, where its matmuls were (CPUs)."""
    cal = runner.calibration()
    if cal.get("forward_ms"):
        cal = dict(cal, pass_ms=measure_pass_ms(runner, draft=draft))
        if draft:
            cal["prefill_row_ms"] = measure_prefill_row_ms(runner)
    return cal
