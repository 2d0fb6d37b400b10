"""Load / soak test of the OpenAI HTTP API (docs/reliability.md).

N concurrent clients send completions and chat requests (half streamed, random lengths and
sampling parameters) for D seconds, then stop by themselves: no request starts after the
deadline, and requests still running are given `--grace` seconds before they are cut off
(and counted). It reports errors by HTTP status (only 429 / 503 backpressure is allowed),
throughput, latency percentiles, and the RSS of every replica process of the application
over time (replica pids from Ray's actor table, RSS from /proc/<pid>/status).

Against a running service (the driver joins its Ray cluster to find the replicas):
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --app specdec --clients 16 --duration 180

Self-contained: starts a private local Ray instance and the application on a free port on
127.0.0.1, runs the load, and shuts it down:
    .venv/bin/python scripts/soak.py --start tiny --clients 64 --duration 180 --out docs/soak_tiny.json
    .venv/bin/python scripts/soak.py --start real --clients 16 --duration 180 --out docs/soak_real.json

Only loopback addresses are accepted.

Longer than 300 lines because it is one self-contained tool: load generator, replica
memory sampling, report and its own private service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from benchmarks.prompts import CODE_PROMPTS
from specdec.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BACKPRESSURE = {429, 503}

PROMPTS = CODE_PROMPTS


# ---- replica memory ----------------------------------------------------------------------------


def replica_pids(app: str) -> dict[str, int]:
    """'<Deployment>#<replica>' -> pid of every live replica of `app` (needs ray.init)."""
    import ray

    out = {}
    for actor in ray._private.state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") == "ALIVE" and f"{app}#" in name and actor.get("Pid"):
            out[name.split(f"{app}#", 1)[1]] = actor["Pid"]
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Samples every replica's RSS every `interval` seconds until stopped."""

    def __init__(self, app: str, interval: float = 5.0):
        super().__init__(daemon=True)
        self.app, self.interval = app, interval
        self.t0 = time.monotonic()
        self.samples: dict[str, list[tuple[float, float]]] = defaultdict(list)  # replica -> (s, MiB)
        self.pids: dict[str, int] = {}
        self._halt = threading.Event()

    def sample(self) -> None:
        try:
            pids = replica_pids(self.app)
        except Exception as error:  # noqa: BLE001 - a missed sample is not fatal
            print(f"rss: actor table not read: {error}", file=sys.stderr)
            return
        self.pids.update(pids)
        now = round(time.monotonic() - self.t0, 1)
        for replica, pid in pids.items():
            mib = rss_mib(pid)
            if mib is not None:
                self.samples[replica].append((now, round(mib, 1)))

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        self.sample()

    def summary(self, warmup_s: float) -> dict:
        """Per replica: RSS at the first sample after `warmup_s`, at the end, the peak and
        the growth between the two."""
        out = {}
        for replica, series in sorted(self.samples.items()):
            after = [m for t, m in series if t >= warmup_s] or [series[-1][1]]
            out[replica] = {
                "pid": self.pids.get(replica),
                "first_mib": series[0][1], "after_warmup_mib": after[0], "last_mib": series[-1][1],
                "max_mib": max(m for _, m in series), "growth_after_warmup_mib": round(series[-1][1] - after[0], 1),
            }
        return out


# ---- clients -----------------------------------------------------------------------------------


@dataclass
class Stats:
    statuses: Counter = field(default_factory=Counter)  # "200", "503", "exc:ClientOSError", ...
    latencies: list[float] = field(default_factory=list)  # successful requests, seconds
    ttfts: list[float] = field(default_factory=list)  # streams: first text chunk
    tokens: int = 0
    stream_errors: Counter = field(default_factory=Counter)  # error events inside a 200 stream
    examples: list[str] = field(default_factory=list)  # a few bodies of unexpected answers
    cut_at_deadline: int = 0


def make_request(rng: random.Random, model: str, max_tokens: tuple[int, int]) -> tuple[str, dict]:
    params = {
        "model": model,
        "max_tokens": rng.randint(*max_tokens),
        "temperature": rng.choice([0.0, 0.6, 0.8, 1.0]),
        "top_p": rng.choice([1.0, 0.95, 0.9]),
        "seed": rng.randrange(1 << 31),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.2:
        params["ignore_eos"] = True
    if params["stream"]:
        params["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", params | {"prompt": rng.choice(PROMPTS)}
    messages = [{"role": "user", "content": "Complete this code:\n" + rng.choice(PROMPTS)}]
    return "/v1/chat/completions", params | {"messages": messages}


async def one_request(session, base: str, path: str, body: dict, stats: Stats, timeout_s: float) -> int | None:
    """Sends one request and counts its outcome; returns the HTTP status (None: no answer)."""
    import aiohttp

    started = time.perf_counter()
    try:
        async with session.post(base + path, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                stats.statuses[str(resp.status)] += 1
                text = await resp.text()
                if resp.status not in BACKPRESSURE and len(stats.examples) < 5:
                    stats.examples.append(f"{resp.status}: {text[:300]}")
                return resp.status
            if body["stream"]:
                first, done = None, False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        stats.stream_errors[str(event["error"].get("type"))] += 1
                        if len(stats.examples) < 5:
                            stats.examples.append(f"stream error: {data[:300]}")
                        return resp.status
                    if first is None and event.get("choices"):
                        first = time.perf_counter() - started
                    if event.get("usage"):
                        stats.tokens += event["usage"]["completion_tokens"]
                if not done:
                    stats.statuses["stream_without_DONE"] += 1
                    return resp.status
                if first is not None:
                    stats.ttfts.append(first)
            else:
                payload = await resp.json()
                stats.tokens += payload["usage"]["completion_tokens"]
            stats.statuses["200"] += 1
            stats.latencies.append(time.perf_counter() - started)
            return 200
    except asyncio.CancelledError:
        stats.cut_at_deadline += 1
        raise
    except Exception as error:  # noqa: BLE001 - every failure is counted by kind
        stats.statuses[f"exc:{type(error).__name__}"] += 1
        if len(stats.examples) < 5:
            stats.examples.append(f"{type(error).__name__}: {error}"[:300])
        return None


async def run_clients(base: str, model: str, clients: int, duration_s: float, *, grace_s: float = 60,
                      max_requests: int | None = None, max_tokens=(8, 64), timeout_s: float = 300,
                      seed: int = 0, progress=None) -> dict:
    """Runs the load; returns the figures (no replica memory: see RssSampler)."""
    import aiohttp

    stats = Stats()
    deadline = time.monotonic() + duration_s
    sent = 0

    async def client(i: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < deadline and (max_requests is None or sent < max_requests):
            sent += 1
            path, body = make_request(rng, model, max_tokens)
            status = await one_request(session, base, path, body, stats, timeout_s)
            if status in BACKPRESSURE:
                await asyncio.sleep(rng.uniform(0.5, 1.5))  # back off, as a client should

    async def report() -> None:
        while True:
            await asyncio.sleep(10)
            if progress:
                progress(f"{time.monotonic() - deadline + duration_s:6.0f}s sent={sent} "
                         f"statuses={dict(stats.statuses)}")

    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=clients + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        reporter = asyncio.create_task(report())
        _, pending = await asyncio.wait(tasks, timeout=duration_s + grace_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        reporter.cancel()
    elapsed = time.monotonic() - started
    ok = len(stats.latencies)

    def pct(xs, q):
        if not xs:
            return None
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)

    errors = {s: n for s, n in stats.statuses.items() if s != "200" and not (s.isdigit() and int(s) in BACKPRESSURE)}
    return {
        "clients": clients, "duration_s": duration_s, "elapsed_s": round(elapsed, 1),
        "requests_sent": sent, "ok": ok, "statuses": dict(stats.statuses),
        "backpressure": {s: n for s, n in stats.statuses.items() if s in ("429", "503")},
        "errors": errors, "stream_errors": dict(stats.stream_errors),
        "cut_at_deadline": stats.cut_at_deadline,
        "throughput_req_s": round(ok / elapsed, 3), "throughput_tok_s": round(stats.tokens / elapsed, 2),
        "completion_tokens": stats.tokens,
        "latency_s": {"p50": pct(stats.latencies, 0.50), "p90": pct(stats.latencies, 0.90),
                      "p99": pct(stats.latencies, 0.99), "max": pct(stats.latencies, 1.0),
                      "mean": round(statistics.fmean(stats.latencies), 3) if ok else None},
        "ttft_s": {"p50": pct(stats.ttfts, 0.50), "p99": pct(stats.ttfts, 0.99)},
        "examples": stats.examples,
    }


def soak(base: str, model: str, app: str, clients: int, duration_s: float, *, rss_interval: float = 5,
         warmup_s: float | None = None, **kw) -> dict:
    """Load plus replica memory (the caller must be connected to the app's Ray cluster)."""
    check_loopback(base)
    sampler = RssSampler(app, rss_interval)
    sampler.start()
    try:
        result = asyncio.run(run_clients(base, model, clients, duration_s, **kw))
    finally:
        sampler.stop()
    warmup = min(30.0, duration_s / 6) if warmup_s is None else warmup_s
    result["rss_warmup_s"] = warmup
    result["rss"] = sampler.summary(warmup)
    result["rss_series"] = {k: v for k, v in sampler.samples.items()}
    return result


def check_loopback(base: str) -> None:
    host = urlparse(base).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {host}: only loopback addresses are allowed")


# ---- a private service --------------------------------------------------------------------------


def app_args(kind: str, workdir: Path) -> dict:
    """The application's args: tiny random pair (as the tests) or the default pair, with
    ray_config.yaml's queue bounds (503 beyond them)."""
    queue = {
        "coordinator_options": {"max_ongoing_requests": 32, "max_queued_requests": 64,
                                "ray_actor_options": {"num_cpus": 0.1}},
        "draft_options": {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 0.5}},
        "target_options": {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 1}},
    }
    if kind == "tiny":
        from specdec.model_pair import ensure_tokenizer
        from specdec.tiny import make_tiny_pair

        draft, target = make_tiny_pair(workdir, ensure_tokenizer())
        runner = {"dtype": "float32", "max_batch_size": 16, "num_threads": 1}
        return {"served_model_name": "tiny", "num_speculative_tokens": 3,
                "draft": {"model": str(draft), **runner}, "target": {"model": str(target), **runner}} | queue
    runner = {"dtype": "bfloat16", "max_batch_size": 16}
    return {"served_model_name": "specdec-qwen2.5-coder", "num_speculative_tokens": 4,
            "draft": {"model": "default-draft", **runner}, "target": {"model": "default-target", **runner}} | queue


def start_service(kind: str, workdir: Path, app: str, batch_invariant: bool = False,
                  niceness: int | None = None) -> tuple[str, str]:
    import ray
    from ray import serve

    sys.path.insert(0, str(ROOT))
    from deployments.app import build_app

    args = app_args(kind, workdir)
    for side in ("draft", "target"):
        args[side]["batch_invariant"] = batch_invariant
    # address="local": a fresh private instance, never a cluster another process started.
    # Workers inherit this environment: they import `deployments` from the checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if niceness is not None:  # Ray starts its workers at nice 15; on a shared machine they starve
        os.environ["RAY_worker_niceness"] = str(niceness)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=app, route_prefix="/")
    return f"http://127.0.0.1:{port}", args["served_model_name"]


def plot_rss(result: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for replica, series in sorted(result["rss_series"].items()):
        if series:
            ax.plot([t for t, _ in series], [m for _, m in series], label=replica.split("#")[0])
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running service (default with --start: its own)")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--app", default="specdec", help="Serve application name (for replica pids)")
    parser.add_argument("--start", choices=["tiny", "real"], default=None,
                        help="start a private Ray + the app on the tiny or the default pair")
    parser.add_argument("--batch-invariant", action="store_true", help="with --start")
    parser.add_argument("--worker-niceness", type=int, default=None,
                        help="with --start: nice level of Ray's workers (Ray's default is 15)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--grace", type=float, default=60, help="seconds for requests running at the deadline")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--max-tokens", default="8,64", help="min,max of max_tokens per request")
    parser.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    parser.add_argument("--rss-interval", type=float, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON figures here (and a .png of RSS beside it)")
    args = parser.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    import ray

    if args.start:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="soak-"))
        t0 = time.monotonic()
        base, model = start_service(args.start, workdir, args.app, args.batch_invariant,
                                    args.worker_niceness)
        log(f"service up at {base} in {time.monotonic() - t0:.0f}s")
    else:
        if not args.url:
            raise SystemExit("give --url of a running service, or --start tiny|real")
        base = args.url.rstrip("/")
        check_loopback(base)
        ray.init(address="auto", log_to_driver=False)  # the service's cluster, for replica pids
        model = args.model
    if model is None or args.model:
        model = args.model or _first_model(base)
    try:
        lo, hi = map(int, args.max_tokens.split(","))
        result = soak(base, model, args.app, args.clients, args.duration, rss_interval=args.rss_interval,
                      grace_s=args.grace, max_requests=args.max_requests, max_tokens=(lo, hi),
                      timeout_s=args.timeout, seed=args.seed, progress=log)
    finally:
        if args.start:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    result["command"] = "python scripts/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        plot_rss(result, str(Path(args.out).with_suffix(".png")),
                 f"replica RSS: {args.clients} clients, {args.duration:.0f}s, {model}")


def _first_model(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:  # loopback only
        return json.load(resp)["data"][0]["id"]


if __name__ == "__main__":
    main()
