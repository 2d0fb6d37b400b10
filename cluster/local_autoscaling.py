"""Independent autoscaling of the Draft and Target pools on Ray's fake multi-node autoscaler.

The head (CPU) holds the Coordinator. Every Draft replica needs a `draft_node` and every
Target replica a `target_node`, one per node, so each Serve scale-up makes the Ray
autoscaler start a worker node of that type (the fake provider runs it on this machine)
and each scale-down lets it stop an idle one, as on a GPU cluster with
cluster/aws_gpu_cluster.yaml. The pools have different `target_ongoing_requests`, so the
load shapes move them separately:

  A  draft-heavy   6 clients, K=8        -> Draft 1->2, Target stays 1
  B  target-only  12 clients, K=0        -> Draft 2->1 (idle), Target 1->2
  C  light         2 clients, K=2        -> Target 2->1 while requests run
  D  idle                                -> both at their minimum, extra nodes stopped

Every request issued is counted; any failure is reported. A replica being removed is
first taken out of routing, then finishes the calls it holds (graceful_shutdown_*); the
coordinator's retry count (from its log) shows whether any call had to be retried.
Replica counts (serve.status()) and node counts are sampled every second and printed as a
timeline.

    python -m cluster.local_autoscaling [--draft DIR --target DIR]

Prints one `RESULT {json}` line (tests/test_autoscaling.py reads it); exit status 0 when
every check passed. Every wait is bounded.

Longer than 300 lines because the scenario is one script: its phases, load generator
and the checks between them read in order.
"""

from __future__ import annotations

import argparse
import glob
import os
import threading
import time
from dataclasses import dataclass, field

from cluster.localcluster import (
    FAST_SERVE_METRICS, alive_nodes, deploy, fake_autoscaling, free_port, log, replica_states,
    result_line, tiny_serve_app, tiny_pair,
)

APP = "specdec"
OBJECT_STORE = 80 * 1024 * 1024
GRACEFUL = {"graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 30}


def autoscaling(target_ongoing: float) -> dict:
    return {
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": 1,
        "target_ongoing_requests": target_ongoing,
        "look_back_period_s": 3,
        # Sustained load for 4 s scales up: the coordinator's fire-and-forget `release`
        # calls arrive in bursts when many requests finish together, and count too.
        "upscale_delay_s": 4,
        # A dip of a few seconds (2 CPU cores shared by every process here) must not
        # cancel a scale-up: scale down only after 10 s below the target.
        "downscale_delay_s": 10,
    }


def serve_app(draft_dir, target_dir) -> dict:
    return tiny_serve_app(APP, draft_dir, target_dir, [
        {"name": "Coordinator", "num_replicas": 1, "max_ongoing_requests": 64,
         "ray_actor_options": {"num_cpus": 0.5}, **GRACEFUL},
        # Draft: scales once ~2 calls are in flight on average.
        {"name": "Draft", "max_ongoing_requests": 32, "autoscaling_config": autoscaling(1.5),
         "ray_actor_options": {"num_cpus": 1, "resources": {"draft_node": 1}}, **GRACEFUL},
        # Target: needs more than 4 to scale.
        {"name": "Target", "max_ongoing_requests": 32, "autoscaling_config": autoscaling(4),
         "ray_actor_options": {"num_cpus": 1, "resources": {"target_node": 1}}, **GRACEFUL},
    ])


WORKER_TYPES = {
    "draft_node_type": {"resources": {"CPU": 1, "draft_node": 1, "object_store_memory": OBJECT_STORE},
                        "min_workers": 1, "max_workers": 2},
    "target_node_type": {"resources": {"CPU": 1, "target_node": 1, "object_store_memory": OBJECT_STORE},
                         "min_workers": 1, "max_workers": 2},
}


@dataclass
class Load:
    """`clients` threads, each issuing one request after another until stopped."""

    handle: object
    clients: int
    k: int
    max_tokens: int = 16
    ok: int = 0
    failed: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            params = {"temperature": 0.8, "seed": i * 1000 + n, "max_tokens": self.max_tokens,
                      "ignore_eos": True, "num_speculative_tokens": self.k}
            try:
                result = self.handle.generate.remote(
                    {"prompt": f"def f{i}_{n}(x):", "sampling_params": params}
                ).result(timeout_s=90)
                assert result.usage.completion_tokens == self.max_tokens, result.usage
                with self._lock:
                    self.ok += 1
            except Exception as error:  # noqa: BLE001 - every failure is reported
                with self._lock:
                    self.failed.append(f"{type(error).__name__}: {str(error)[:300]}")
            n += 1

    def stop(self, timeout_s: float = 120) -> None:
        """Stops issuing; the requests in flight finish (and are counted)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Timeline:
    """Samples replica and node counts every second in the background."""

    def __init__(self, t0: float):
        self.t0, self.rows, self.phase = t0, [], "deploy"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(1.0)

    def sample(self) -> dict:
        try:
            states = replica_states(APP)
            nodes = alive_nodes()
        except Exception:  # noqa: BLE001 - a missed sample is not a failure
            return {}
        running = {name: s.get("RUNNING", 0) for name, s in states.items()}
        other = {name: sum(n for st, n in s.items() if st != "RUNNING") for name, s in states.items()}
        row = {
            "t": round(time.monotonic() - self.t0, 1),
            "phase": self.phase,
            "draft": running.get("Draft", 0),
            "target": running.get("Target", 0),
            "coordinator": running.get("Coordinator", 0),
            # replicas starting or stopping (not serving)
            "draft_other": other.get("Draft", 0),
            "target_other": other.get("Target", 0),
            "draft_nodes": sum(1 for n in nodes if n["Resources"].get("draft_node")),
            "target_nodes": sum(1 for n in nodes if n["Resources"].get("target_node")),
        }
        self.rows.append(row)
        return row

    def latest(self) -> dict:
        return self.rows[-1] if self.rows else {}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for(timeline: Timeline, condition, timeout_s: float, hold_s: float = 0.0) -> bool:
    """True once `condition(latest row)` has held for hold_s seconds; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    since = None
    while time.monotonic() < deadline:
        row = timeline.latest()
        if row and condition(row):
            since = since or time.monotonic()
            if time.monotonic() - since >= hold_s:
                return True
        else:
            since = None
        time.sleep(0.5)
    return False


def drain_log(session_dir: str) -> dict[str, list[int]]:
    """{deployment: [the most ongoing requests a stopping replica waited for, per stopped
    replica]} from the replicas' graceful-shutdown log lines."""
    import re

    waited: dict[str, list[int]] = {}
    for path in sorted(glob.glob(os.path.join(session_dir, "logs", "serve", f"replica_{APP}_*.log"))):
        deployment = os.path.basename(path).split("_")[2]
        most, drained = 0, False
        with open(path, errors="replace") as f:
            for line in f:
                match = re.search(r"Waiting for an additional .*?: (\d+) ongoing requests", line)
                if match:
                    most = max(most, int(match.group(1)))
                drained = drained or "Drained ongoing requests" in line
        if drained:
            waited.setdefault(deployment, []).append(most)
    return waited


def coordinator_retries(session_dir: str) -> int:
    """Draft / target calls the coordinator had to retry because a replica was lost."""
    count = 0
    for path in glob.glob(os.path.join(session_dir, "logs", "serve", "replica_*Coordinator*.log")):
        with open(path, errors="replace") as f:
            count += sum(1 for line in f if "call failed (attempt" in line)
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.local_autoscaling", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", help="draft model folder (default: a tiny random pair)")
    parser.add_argument("--target", help="target model folder")
    parser.add_argument("--phase-timeout", type=float, default=75.0, help="seconds each phase may take at most")
    args = parser.parse_args(argv)
    draft_dir, target_dir = (args.draft, args.target) if args.draft else tiny_pair()

    import ray

    t0 = time.monotonic()
    checks: dict[str, bool] = {}
    phases: dict[str, dict] = {}
    loads: list[Load] = []
    with fake_autoscaling({"CPU": 2}, WORKER_TYPES, idle_timeout_minutes=0.1, env=FAST_SERVE_METRICS) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        timeline = Timeline(t0).start()
        handle = deploy(serve_app(draft_dir, target_dir), http_port=free_port(), timeout_s=150)
        log(f"application RUNNING after {time.monotonic() - t0:.1f} s: {timeline.sample()}")

        def phase(name: str, clients: int, k: int, goal, hold_s: float = 3.0) -> Load | None:
            timeline.phase = name
            start = time.monotonic()
            load = Load(handle, clients, k).start() if clients else None
            if load:
                loads.append(load)
            reached = wait_for(timeline, goal, args.phase_timeout, hold_s)
            phases[name] = {"reached": reached, "seconds": round(time.monotonic() - start, 1),
                            "end": timeline.latest()}
            log(f"phase {name}: {'reached' if reached else 'NOT reached'} in {phases[name]['seconds']} s: {timeline.latest()}")
            return load

        # Independence is shown by the draft pool at 2 while the target pool is at 1 (held 3 s);
        # the target may briefly scale too when the 6 requests' first target calls (prefills)
        # and their release calls arrive together, which is its own metric doing its job.
        load = phase("A draft-heavy", 6, 8, lambda r: r["draft"] == 2 and r["target"] == 1)
        seen_a = [r for r in timeline.rows if r["phase"] == "A draft-heavy"]
        load.stop()
        load = phase("B target-only", 12, 0, lambda r: r["target"] == 2 and r["draft"] == 1)
        seen_b = [r for r in timeline.rows if r["phase"] == "B target-only"]
        load.stop()
        load = phase("C light", 2, 2, lambda r: r["target"] == 1 and r["draft"] == 1)
        load.stop()
        phase("D idle", 0, 0, lambda r: r["draft_nodes"] == 1 and r["target_nodes"] == 1, hold_s=0)
        timeline.stop()

        ok = sum(l.ok for l in loads)
        failed = [f for l in loads for f in l.failed]
        retries = coordinator_retries(cluster.session_dir)
        drained = drain_log(cluster.session_dir)
        checks["draft scaled up under draft-heavy load"] = phases["A draft-heavy"]["reached"]
        checks["draft at 2 while target at 1 under draft-heavy load"] = any(
            r["draft"] == 2 and r["target"] == 1 for r in seen_a)
        checks["target scaled up and draft down under target-only load"] = phases["B target-only"]["reached"]
        checks["target scaled down under light load"] = phases["C light"]["reached"]
        checks["extra nodes stopped when idle"] = phases["D idle"]["reached"]
        checks["no request failed"] = not failed and ok > 0
        downs = [
            (prev["t"], key) for prev, row in zip(timeline.rows, timeline.rows[1:])
            for key in ("draft", "target") if row[key] < prev[key]
        ]
        log(f"requests ok {ok}, failed {len(failed)}, coordinator retries {retries}, scale-downs at {downs}")
        log(f"stopped replicas drained (most in-flight calls waited for, per replica): {drained}")
        for f in failed[:5]:
            log("failure:", f)
        log("timeline: t (s) | phase | running replicas draft target coordinator "
            "(+starting/stopping) | draft/target nodes")
        last = None
        for r in timeline.rows:
            key = tuple(v for k, v in r.items() if k != "t")
            if key != last:
                extra = lambda n: f"(+{n})" if n else "    "  # noqa: E731
                log(f"  {r['t']:6.1f} | {r['phase']:<14} | draft {r['draft']}{extra(r['draft_other'])} "
                    f"target {r['target']}{extra(r['target_other'])} coord {r['coordinator']} | "
                    f"nodes {r['draft_nodes']}/{r['target_nodes']}")
                last = key
        for name, passed in checks.items():
            log(("PASS " if passed else "FAIL ") + name)
        result_line({
            "checks": checks, "phases": phases, "timeline": timeline.rows,
            "requests_ok": ok, "requests_failed": failed, "coordinator_retries": retries, "drained": drained,
            "seconds": round(time.monotonic() - t0, 1), "peak_b": max((r["target"] for r in seen_b), default=0),
        })
    log(f"cluster stopped after {time.monotonic() - t0:.1f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
