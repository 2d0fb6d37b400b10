"""The service's speed (docs/serve_speed.md), in one run: start `serve run <config>`,
time it to the first answer, then measure tokens/s over HTTP, target-only vs speculative
(K = 2, 3, 4), greedy and T=0.6 / top_p=0.9, 1 and 8 requests in flight, with the acceptance
rates (the benchmark's --url mode does the sweep; see docs/benchmark.md).

    .venv/bin/python scripts/serve_speed.py --out docs/serve_speed

Writes <out>/results.json, report.md and plots, and <out>/startup.json."""

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
    p.add_argument("--max-tokens", default="32")
    p.add_argument("--ks", default="2,3,4")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--startup-deadline-s", type=float, default=1800)
    args, bench_extra = p.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    serve_bin = Path(sys.executable).with_name("serve")
    log = open(out / "serve_run.log", "w")
    started = time.monotonic()
    server = subprocess.Popen([str(serve_bin), "run", args.config], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ttfa = first_answer(args.url, args.startup_deadline_s, server)
        startup = {"config": args.config, "serve_run_to_first_answer_s": round(ttfa, 1),
                   "note": "default pair already converted in the cache; Ray start, replica "
                           "start, model load and one 1-token completion"}
        (out / "startup.json").write_text(json.dumps(startup, indent=1))
        print(f"serve run -> first answer: {ttfa:.1f} s", flush=True)

        from benchmarks.__main__ import main as bench

        rc = bench(["--url", args.url, "--out", str(out), "--ks", args.ks,
                    "--settings", "greedy,t0.6p0.9", "--raw-settings", "",
                    "--batched-settings", "all", "--concurrency", args.concurrency,
                    "--max-tokens", args.max_tokens, "--guard-n", "0", "--hf-prompts", "0",
                    *bench_extra])
        report = json.loads((out / "results.json").read_text())
        report["startup"] = startup
        (out / "results.json").write_text(json.dumps(report, indent=1))
        return rc
    finally:
        os.killpg(server.pid, signal.SIGINT)  # serve run shuts its local Ray down
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        print(f"total {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
