"""Greedy speculative text vs target-only greedy text on the real pair in bf16, 8 requests
batched (the setting where docs/serve_speed.md saw 1-2 of 8 differ), with and without
batch_invariant. Writes a JSON summary.

    PYTHONPATH=. .venv/bin/python scripts/greedy_exactness_real.py --out docs/greedy_exactness_real.json
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import prompts
from specdec.local import LocalEngine
from specdec.model_pair import ensure_default_pair


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--modes", default="true,false")
    p.add_argument("--out", default="greedy_exactness_real.json")
    args = p.parse_args()
    draft, target = ensure_default_pair()
    texts = [x.text for pair in zip(prompts.load("humaneval", 4), prompts.load("prose", 4)) for x in pair]
    summary = {"k": args.k, "tokens": args.tokens, "requests": len(texts), "dtype": "bfloat16"}
    for mode in args.modes.split(","):
        invariant = mode == "true"
        engine = LocalEngine(draft, target, dtype="bfloat16", batch_invariant=invariant)
        outs = {}
        for k in (0, args.k):
            reqs = [{"prompt": t, "sampling_params": {"temperature": 0.0, "max_tokens": args.tokens,
                                                      "min_tokens": args.tokens,
                                                      "num_speculative_tokens": k}} for t in texts]
            t0 = time.time()
            outs[k] = [r.token_ids for r in engine.generate(reqs, batch_size=len(reqs))]
            print(f"batch_invariant={invariant} K={k}: {time.time() - t0:.0f} s", flush=True)
        differ = [i for i, (a, b) in enumerate(zip(outs[0], outs[args.k])) if a != b]
        first = [next(j for j, (x, y) in enumerate(zip(outs[0][i], outs[args.k][i])) if x != y)
                 for i in differ]
        summary[f"batch_invariant={invariant}"] = {"differing": len(differ), "of": len(texts),
                                                   "first_divergence": first}
        print(summary, flush=True)
        del engine
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
