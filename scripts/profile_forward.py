"""Operator calls per forward pass, by number of requests and K (torch.profiler, CPU).

Loads a small random-weight model (4 layers, the real 151,936-token vocabulary) in a
ModelRunner, gives every request a 40-token prompt, then profiles one verify-shaped call:
`requests` requests with K+1 new rows each, as a target pass of a speculative round sees.
Counts every aten operator call, and separately the matmul-kernel and attention calls. The
count must not grow with requests or K as long as the rows fit one padded / blocked matmul
call; beyond that a kernel adds one call per weight per block of rows (fixed shapes are what
make rows batch-invariant).

    .venv/bin/python scripts/profile_forward.py --out docs/engine_profile.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.model_pair import ensure_default_pair
from specdec.runner import ModelRunner
from specdec.tiny import make_tiny_model

MATMUL_OPS = ("aten::linear", "aten::matmul", "aten::mm", "aten::bmm", "aten::addmm",
              "aten::_weight_int8pack_mm", "quantized::linear_dynamic_fp16")


def count_ops(runner: ModelRunner, requests: int, k: int, prompt: int = 40) -> dict:
    ids = [[(7 * r + i) % 50_000 + 100 for i in range(prompt + k + 1)] for r in range(requests)]
    runner.extend([(f"r{r}", ids[r][:prompt], 1) for r in range(requests)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.extend([(f"r{r}", ids[r], k + 1) for r in range(requests)])
    for r in range(requests):
        runner.release(f"r{r}")
    calls = Counter()
    for event in prof.events():
        calls[event.name] += 1
    aten = sum(n for name, n in calls.items() if name.startswith(("aten::", "quantized::")))
    return {"requests": requests, "k": k, "rows": requests * (k + 1), "op_calls": aten,
            "matmul_calls": sum(calls[name] for name in MATMUL_OPS)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the counts here (JSON)")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    _, target = ensure_default_pair()
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", target, num_layers=4)
    rows = []
    for invariant in (True, False):
        runner = ModelRunner(model_dir, dtype=args.dtype, batch_invariant=invariant)
        count_ops(runner, 1, 0)  # warm-up
        for requests in (1, 4, 8):
            for k in (0, 3, 5):
                row = dict(count_ops(runner, requests, k), batch_invariant=invariant,
                           kernels=runner.calibration()["kernels"])
                rows.append(row)
                print(f"invariant={invariant} requests={requests} K={k} rows={row['rows']}: "
                      f"{row['op_calls']} operator calls, {row['matmul_calls']} matmul calls")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": "tiny, 4 layers", "dtype": args.dtype,
                                              "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
