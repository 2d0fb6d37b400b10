"""The service against the in-process engine, taking turns prompt by prompt (docs/serve_speed.md).

`scripts/serve_speed.py` sets the service's cells beside an earlier in-process benchmark
run; on a shared VM the two runs can be minutes or hours apart and the machine's speed drifts
by 10-30 % in between. This script loads the shipped configuration in process beside a
running service (`./run.sh serve`) and runs target-only and speculative requests through
both, one HumanEval prompt at a time, every arm on prompt i before any on prompt i + 1
(benchmarks.shipped.interleaved_units), so the ratio sees one machine.

    .venv/bin/python scripts/service_vs_in_process.py --prompts 6 --temperature 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import prompts  # noqa: E402
from benchmarks.backends import HttpBackend  # noqa: E402
from benchmarks.shipped import _requests, interleaved_units, shipped_backend, shipped_config  # noqa: E402
from specdec.model_pair import ensure_default_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.0, help="with top_p 0.9 when > 0")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    cfg = shipped_config()
    local = shipped_backend(*ensure_default_pair(), cfg)
    service = HttpBackend(args.url, local.tokenizer)
    ids = [local.tokenizer(p.text)["input_ids"] for p in prompts.load_humaneval(args.prompts)]
    params = {"temperature": args.temperature}
    if args.temperature > 0:
        params["top_p"] = 0.9
    arms = [(name, backend, k) for name, backend in (("service", service), ("in process", local))
            for k in (0, None)]  # K=0: target-only; None: the deployment's adaptive K
    local.run(_requests(ids[:1], params, k=None, max_tokens=4, seed0=0), 1)  # warm-up
    tokens, seconds = [0] * len(arms), [0.0] * len(arms)
    for arm, (i,) in interleaved_units(len(arms), [[i] for i in range(len(ids))]):
        _, backend, k = arms[arm]
        outs, stats = backend.run(_requests([ids[i]], params, k=k, max_tokens=args.max_tokens,
                                            seed0=1234 + i), 1)
        tokens[arm] += outs[0].num_tokens
        seconds[arm] += stats.wall_s
    speed = [t / s for t, s in zip(tokens, seconds)]
    for (name, _, k), tps in zip(arms, speed):
        print(f"{name:10s} {'target-only' if k == 0 else 'speculative':11s} {tps:6.2f} tok/s")
    print(f"service / in process: target-only {speed[0] / speed[2]:.2f}x, "
          f"speculative {speed[1] / speed[3]:.2f}x")


if __name__ == "__main__":
    main()
