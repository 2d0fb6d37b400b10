"""The service's speed (docs/serve_speed.md), in one run: start `serve run <config>`,
time it to the first answer (with the environment of `./run.sh serve`, cluster/cpu_node.env),
then run the benchmark's shipped-configuration cells over HTTP and in process, side by side
(benchmarks.shipped.measure_cells: 12 HumanEval prompts one at a time and 8 at once, 64
tokens, target-only vs the configured speculation, greedy and T=0.6 / top_p=0.9). The
in-process engine (the shipped configuration, loaded in this script's process) and the
service take turns prompt by prompt and batch by batch, so "service / in process" compares
one machine, not two runs minutes apart on a VM whose speed drifts.

    .venv/bin/python scripts/serve_speed.py --out docs/serve_speed

Writes <out>/results.json, <out>/report.md and <out>/startup.json.
`--no-in-process`: the service's cells only (a node whose accelerator the service holds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.node_env import cpu_node_env, read_env_file  # noqa: E402


def first_answer(url: str, deadline_s: float, server: subprocess.Popen) -> float:
    """Seconds until a one-token completion returns 200 (polling once a second)."""
    start = time.monotonic()
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 1}).encode()
    while time.monotonic() - start < deadline_s:
        if server.poll() is not None:
            raise SystemExit(f"serve run exited with {server.returncode} before answering")
        try:
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"no answer within {deadline_s} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out", default="results/serve_speed")
    p.add_argument("--no-in-process", action="store_true",
                   help="do not load the engine in process beside the service")
    p.add_argument("--prompts", type=int, default=12, help="HumanEval prompts one at a time")
    p.add_argument("--batch", type=int, default=8, help="HumanEval prompts at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settings", default="greedy,t0.6p0.9")
    p.add_argument("--startup-deadline-s", type=float, default=1800)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    serve_bin = Path(sys.executable).with_name("serve")
    env = cpu_node_env()  # what ./run.sh serve sets
    log = open(out / "serve_run.log", "w")
    started = time.monotonic()
    server = subprocess.Popen([str(serve_bin), "run", args.config], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    try:
        ttfa = first_answer(args.url, args.startup_deadline_s, server)
        startup = {"config": args.config, "serve_run_to_first_answer_s": round(ttfa, 1),
                   "node_env": {k: env[k] for k in read_env_file()},
                   "note": "default pair already converted in the cache; Ray start, replica "
                           "start, model load (with the kernel calibration, cached per "
                           "machine) and one 1-token completion"}
        (out / "startup.json").write_text(json.dumps(startup, indent=1))
        print(f"serve run -> first answer: {ttfa:.1f} s", flush=True)
        report = measure(args, startup)
        (out / "results.json").write_text(json.dumps(report, indent=1))
        (out / "report.md").write_text("\n".join(markdown(report)) + "\n")
        print("\n".join(markdown(report)))
        return 0
    finally:
        os.killpg(server.pid, signal.SIGINT)  # serve run shuts its local Ray down
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        print(f"total {time.monotonic() - started:.0f} s", flush=True)


def warm_up(backend, ids, args) -> None:
    """Every prompt once alone and the batch once together, a few tokens each, before the
    measured cells: a fresh replica's first pass at a new row count costs extra (kernel
    set-up), and an in-process benchmark reaches its shipped cells after other cells over
    the same prompts. Measured on a 2-core AMX Xeon, target-only one at a time: 3.88 tok/s
    over the first two prompts after start, 4.61-4.71 once warm (12 prompts 4.65, in
    process 4.74)."""
    from benchmarks.shipped import _requests

    backend.run(_requests(ids[: args.prompts], {"temperature": 1.0}, k=None, max_tokens=4,
                          seed0=0), 1)
    backend.run(_requests(ids[: args.batch], {"temperature": 1.0}, k=None, max_tokens=4,
                          seed0=0), args.batch)


def measure(args, startup: dict) -> dict:
    from transformers import AutoTokenizer

    from benchmarks import prompts
    from benchmarks.backends import HttpBackend
    from benchmarks.run import machine_info, parse_setting
    from benchmarks.shipped import IN_PROCESS, measure_cells, ratios, shipped_backend, shipped_config
    from specdec.model_pair import ensure_default_pair

    cfg = shipped_config(ROOT / args.config)
    pair = ensure_default_pair()
    tok = AutoTokenizer.from_pretrained(str(pair[1]))
    ids = [tok(p.text)["input_ids"] for p in prompts.load_humaneval(max(args.prompts, args.batch))]
    backends = {"service": HttpBackend(args.url, tok)}
    if not args.no_in_process:
        backends[IN_PROCESS] = shipped_backend(*pair, cfg)
    settings = [parse_setting(x) for x in args.settings.split(",")]
    for backend in backends.values():
        warm_up(backend, ids, args)
    rows = measure_cells(backends, ids, settings, single=args.prompts, batch=args.batch,
                         max_tokens=args.max_tokens, seed0=1234,
                         invariants=(cfg.target.batch_invariant,), adaptive_k=cfg.adaptive_k,
                         drafter_invariant=cfg.drafter_invariant)
    ratios(rows, cfg.target.batch_invariant)
    for r in rows:
        del r["texts"]
    return {"startup": startup, "machine": machine_info(), "config": args.config,
            "max_tokens": args.max_tokens, "rows": rows}


def markdown(report: dict) -> list[str]:
    lines = [f"# Through the service ({report['config']}), beside the engine in process", "",
             f"- machine: {report['machine']}",
             f"- serve run to first answer: {report['startup']['serve_run_to_first_answer_s']} s",
             f"- Ray / Serve environment: {report['startup'].get('node_env', 'Ray defaults')}",
             f"- {report['max_tokens']} tokens per request; the service's cells and the same "
             "cells in process (the shipped configuration loaded beside the service) take turns "
             "prompt by prompt and batch by batch", "",
             "| place | setting | c | mode | tok/s | vs target-only | acceptance | mean K "
             "| service / in process | text = target-only |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        def f(x, fmt="{:.2f}"):
            return "" if x is None else fmt.format(x)
        same = f"{r['same_text']}/{r['requests']}" if "same_text" in r else ""
        lines.append(f"| {r['place']} | {r['setting_label']} | {r['concurrency']} | {r['mode']} | "
                     f"{r['tokens_per_s']:.2f} | {f(r.get('speedup'), '{:.2f}x')} | "
                     f"{f(r['acceptance_rate'])} | {f(r['mean_k'])} | "
                     f"{f(r.get('vs_in_process'), '{:.2f}x')} | {same} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
