"""Micro-benchmark of one speculative round's sampling work (not a test).

16 requests, K = 4, vocabulary 151,936, on this machine's CPU:
  draft side   4 steps x (process 16 rows, then sample 16 tokens)  (the draft runs step by step)
  target side  process 16 x 5 rows (speculative_rows: each row sees the earlier proposals)
  rejection    rejection_sample over [16, 4] proposals
Prints the median milliseconds of each stage over the repeats, wall time and CPU time (the
processing stages are `specdec.processing`; the sampling ones `randomness` and `rejection`).

    .venv/bin/python scripts/bench_sampling.py [--repeats 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from specdec.params import SamplingParams
from specdec.processing import RequestSampling, Row, process_logits, speculative_rows
from specdec.randomness import Purpose, sample
from specdec.rejection import rejection_sample

B, K, V = 16, 4, 151_936
PROMPT_LEN, OUTPUT_LEN = 200, 100
STAGES = ("draft process 4x16", "draft sample 4x16", "target process 16x5", "rejection_sample",
          "total")

CONFIGS = {
    "T=0.6 top_p=0.9 rep=1.1": dict(temperature=0.6, top_p=0.9, repetition_penalty=1.1),
    "greedy": dict(temperature=0.0),
    "drafter-invariant T=0.6 top_p=0.9 rep=1.1": dict(
        temperature=0.6, top_p=0.9, repetition_penalty=1.1, drafter_invariant=True
    ),
}


def lm_like_logits(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Spread-out noise plus a few strong candidates, roughly the shape of LM logits."""
    logits = torch.randn(rows, V, generator=gen) * 2.0
    top = torch.randint(0, V, (rows, 20), generator=gen)
    logits.scatter_add_(1, top, 12.0 + 6.0 * torch.rand(rows, 20, generator=gen))
    return logits


def make_requests(params: dict, gen: torch.Generator):
    reqs, outputs = [], []
    for _ in range(B):
        prompt = tuple(torch.randint(0, V, (PROMPT_LEN,), generator=gen).tolist())
        reqs.append(RequestSampling(SamplingParams(**params), prompt))
        outputs.append(tuple(torch.randint(0, V, (OUTPUT_LEN,), generator=gen).tolist()))
    return reqs, outputs


class Clock:
    """Wall and CPU (process) time per stage. On a shared machine the CPU time is the robust
    figure with --threads 1: it excludes the time other processes hold the cores."""

    def __init__(self):
        self.wall = {stage: [] for stage in STAGES}
        self.cpu = {stage: [] for stage in STAGES}

    @staticmethod
    def now():
        return time.perf_counter(), time.process_time()

    def add(self, stage, start, end=None):
        end = end or self.now()
        self.wall[stage].append(end[0] - start[0])
        self.cpu[stage].append(end[1] - start[1])


def one_round(reqs, outputs, draft_logits, target_logits, seeds, positions, inv, clock):
    t0 = clock.now()
    proposals = [[] for _ in range(B)]
    q_steps, sampling = [], [0.0, 0.0]
    for i in range(K):  # the draft: one processing + sampling step per proposal
        rows = [Row(r, o + tuple(p)) for r, o, p in zip(reqs, outputs, proposals)]
        q = process_logits(draft_logits[i], rows).probs
        s0 = clock.now()
        tok = sample(q, seeds, positions + i, Purpose.DRAFT, inv).tolist()
        s1 = clock.now()
        sampling = [sampling[0] + s1[0] - s0[0], sampling[1] + s1[1] - s0[1]]
        for b, t in enumerate(tok):
            proposals[b].append(t)
        q_steps.append(q)
    t1 = clock.now()
    rows = [row for r, o, p in zip(reqs, outputs, proposals) for row in speculative_rows(r, o, p)]
    p = process_logits(target_logits, rows).probs.view(B, K + 1, V)
    t2 = clock.now()
    res = rejection_sample(torch.tensor(proposals), torch.full((B,), K),
                           None if bool(inv.all()) else torch.stack(q_steps, 1),
                           p, seeds, positions, inv)
    t3 = clock.now()
    draft_end = (t1[0] - sampling[0], t1[1] - sampling[1])
    clock.add("draft process 4x16", t0, draft_end)
    clock.add("draft sample 4x16", (0.0, 0.0), tuple(sampling))
    clock.add("target process 16x5", t1, t2)
    clock.add("rejection_sample", t2, t3)
    clock.add("total", t0, t3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"B={B} K={K} V={V} torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.repeats} rounds per configuration (after one warm-up), load average "
          f"{open('/proc/loadavg').read().split()[0]}")
    gen = torch.Generator().manual_seed(0)
    draft_logits = [lm_like_logits(B, gen) for _ in range(K)]
    target_logits = lm_like_logits(B * (K + 1), gen)
    seeds, positions = torch.arange(B) * 7919 + 1, torch.full((B,), OUTPUT_LEN)
    clocks = {}
    for name, params in CONFIGS.items():
        reqs, outputs = make_requests(params, gen)
        inv = torch.full((B,), bool(params.get("drafter_invariant", False)))
        one_round(reqs, outputs, draft_logits, target_logits, seeds, positions, inv, Clock())
        clocks[name] = Clock()
        for _ in range(args.repeats):
            one_round(reqs, outputs, draft_logits, target_logits, seeds, positions, inv,
                      clocks[name])
    for kind in ("wall", "cpu"):
        print(f"\n{kind} time, median ms" + "".join(f"{stage:>22}" for stage in STAGES))
        for name, clock in clocks.items():
            row = getattr(clock, kind)
            print(f"{name:<44}"[:44] + "".join(f"{statistics.median(row[st]) * 1e3:>22.1f}"
                                                for st in STAGES))


if __name__ == "__main__":
    main()
