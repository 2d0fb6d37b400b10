"""What torch.compile gains or costs on this machine's forward passes, beside eager.

For the default pair as shipped (dtype auto, batch-invariant kernels) it times one forward
of each shape a speculative round issues: a draft decode (1 row), a target verify (K+1 = 4
rows) and a verify of 8 requests (32 rows), and a target verify in plain float32 (aten
operators only, so all of the forward can be traced), at a fixed context, eager and compiled
(`torch.compile(forward, dynamic=False)`: one graph per shape, the fixed-shape buckets a
compiled decode needs). It also reports the compile time of the first call, the time of a
call whose context crossed into a new KV block (a new shape for the attention), and whether
the compiled logits are bitwise those of eager (batch invariance is a bitwise property: a
compiled graph per shape may round differently from another shape's).

    .venv/bin/python scripts/compile_speed.py --out docs/compile_speed.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.run import machine_info
from specdec.attention import BLOCK_SIZE
from specdec.model_pair import ensure_default_pair
from specdec.runner import ModelRunner

CONTEXT = 10 * BLOCK_SIZE + 3  # a prompt this long, then the measured call


def _call_ms(runner: ModelRunner, requests: int, rows: int, context: int, repeats: int):
    ids = [[(7 * i + 13 * r) % 50_000 + 100 for i in range(context + rows)] for r in range(requests)]
    times, out = [], None
    for _ in range(repeats):
        runner.extend([(f"r{r}", ids[r][:context], 1) for r in range(requests)])
        t = time.perf_counter()
        out = runner.extend([(f"r{r}", ids[r], rows) for r in range(requests)])
        times.append((time.perf_counter() - t) * 1e3)
    for r in range(requests):
        runner.release(f"r{r}")
    return times, torch.cat(out)


def measure(runner: ModelRunner, requests: int, rows: int, repeats: int) -> dict:
    eager_ms, eager_out = _call_ms(runner, requests, rows, CONTEXT, repeats)
    forward = runner.model.forward
    # The forward runs under inference_mode, whose tensors a compiled graph cannot take
    # ("Cannot set version_counter for inference tensor"): compile the plain function and
    # run it under no_grad instead.
    plain = torch.compile(functools.partial(type(runner.model).forward.__wrapped__, runner.model),
                          dynamic=False)
    runner.model.forward = torch.no_grad()(plain)
    try:
        first_ms, _ = _call_ms(runner, requests, rows, CONTEXT, 1)
        compiled_ms, compiled_out = _call_ms(runner, requests, rows, CONTEXT, repeats)
        new_block_ms, _ = _call_ms(runner, requests, rows, CONTEXT + BLOCK_SIZE, 1)
    finally:
        runner.model.forward = forward
        torch._dynamo.reset()
    eager, compiled = statistics.median(eager_ms), statistics.median(compiled_ms)
    return dict(requests=requests, rows_each=rows, eager_ms=round(eager, 1),
                compiled_ms=round(compiled, 1), speedup=round(eager / compiled, 3),
                first_call_s=round(first_ms[0] / 1e3, 1),
                new_kv_block_call_s=round(new_block_ms[0] / 1e3, 1),
                bitwise_equal_to_eager=bool(torch.equal(eager_out, compiled_out)),
                max_abs_diff=float((eager_out - compiled_out).abs().max()))


SHIPPED = dict(dtype="auto", batch_invariant=True)
PLAIN = dict(dtype="float32", batch_invariant=False)  # aten ops only: all of it traceable
CELLS = [("draft", SHIPPED, 1, 1), ("target", SHIPPED, 1, 4), ("target", SHIPPED, 8, 4),
         ("target", PLAIN, 1, 4)]


def run_cell(index: int, repeats: int) -> dict:
    name, kw, requests, rows = CELLS[index]
    runner = ModelRunner(dict(zip(("draft", "target"), ensure_default_pair()))[name], **kw)
    cell = dict(model=name, format=runner.calibration().get("format"),
                batch_invariant=kw["batch_invariant"], requests=requests, rows_each=rows)
    try:
        cell.update(measure(runner, requests, rows, repeats))
    except Exception as exc:  # a failed compile is a result too: say which and why
        causes = [ln for ln in str(exc).splitlines() if "Error:" in ln] or [str(exc)]
        cell.update(compile_error=f"{type(exc).__name__}: {causes[-1].strip()}")
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cell", type=int, help=argparse.SUPPRESS)  # one cell, in this process
    args = p.parse_args()
    if args.cell is not None:
        print("CELL " + json.dumps(run_cell(args.cell, args.repeats)), flush=True)
        return
    ensure_default_pair()
    cells = []
    for i in range(len(CELLS)):  # each in its own process: a failed compile leaves torch's
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--repeats",  # state
                               str(args.repeats), "--cell", str(i)],  # unusable
                              capture_output=True, text=True)
        lines = [ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("CELL ")]
        cell = json.loads(lines[0]) if lines else dict(cell=i, error=proc.stderr[-500:])
        print(json.dumps(cell), flush=True)
        cells.append(cell)
    out = dict(machine=machine_info(), torch=torch.__version__, context=CONTEXT, cells=cells)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
