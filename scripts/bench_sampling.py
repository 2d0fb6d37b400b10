"""Micro-benchmark of one speculative round's sampling work (not a test).

16 requests, K = 4, vocabulary 151,936, on this machine's CPU:
  draft side   4 steps x (process 16 rows + sample 16 tokens)  (the draft runs step by step)
  target side  process 16 x 5 rows (speculative_rows: each row sees the earlier proposals)
  rejection    rejection_sample over [16, 4] proposals
Prints the median milliseconds of each stage over the repeats.

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
STAGES = ("draft 4x(process+sample 16)", "target process 16x5", "rejection_sample", "total")

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


def one_round(reqs, outputs, draft_logits, target_logits, seeds, positions, inv, times):
    t0 = time.perf_counter()
    proposals = [[] for _ in range(B)]
    q_steps = []
    for i in range(K):  # the draft: one processing + sampling step per proposal
        rows = [Row(r, o + tuple(p)) for r, o, p in zip(reqs, outputs, proposals)]
        q = process_logits(draft_logits[i], rows).probs
        tok = sample(q, seeds, positions + i, Purpose.DRAFT, inv)
        for b, t in enumerate(tok.tolist()):
            proposals[b].append(t)
        q_steps.append(q)
    t1 = time.perf_counter()
    rows = [row for r, o, p in zip(reqs, outputs, proposals) for row in speculative_rows(r, o, p)]
    p = process_logits(target_logits, rows).probs.view(B, K + 1, V)
    t2 = time.perf_counter()
    res = rejection_sample(torch.tensor(proposals), torch.full((B,), K),
                           None if bool(inv.all()) else torch.stack(q_steps, 1),
                           p, seeds, positions, inv)
    t3 = time.perf_counter()
    for stage, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
        times[stage].append(dt)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"B={B} K={K} V={V} torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} rounds (ms)")
    gen = torch.Generator().manual_seed(0)
    draft_logits = [lm_like_logits(B, gen) for _ in range(K)]
    target_logits = lm_like_logits(B * (K + 1), gen)
    seeds, positions = torch.arange(B) * 7919 + 1, torch.full((B,), OUTPUT_LEN)
    print(f"{'':<44}" + "".join(f"{stage:>30}" for stage in STAGES))
    for name, params in CONFIGS.items():
        reqs, outputs = make_requests(params, gen)
        inv = torch.full((B,), bool(params.get("drafter_invariant", False)))
        times: dict[str, list[float]] = {stage: [] for stage in STAGES}
        for i in range(args.repeats + 1):  # the first round is a warm-up
            one_round(reqs, outputs, draft_logits, target_logits, seeds, positions, inv,
                      times if i else {stage: [] for stage in STAGES})
        print(f"{name:<44}" + "".join(f"{statistics.median(times[st]) * 1e3:>30.1f}"
                                      for st in STAGES))


if __name__ == "__main__":
    main()
