"""Local multi-node Ray clusters on one machine, for tests and demos.

* `multinode(...)`: a head and worker nodes (`ray.cluster_utils.Cluster`: real raylets,
  each its own Ray node, on this machine's address) with custom resources.
* `fake_autoscaling(...)`: a head whose autoscaler (Ray's fake multi-node provider) starts
  and stops worker nodes of the given types on this machine, as a cloud provider would.

Both stop only the processes of their own cluster (its session folder is on their command
lines). Never `ray stop`: other Ray instances on the machine (other users' tests) live on.
Ray's own `AutoscalingCluster` cannot be used here: its start and shutdown run
`ray stop --force` (every Ray process of the machine), it takes the fixed GCS port 6379, and
this Ray wheel lacks the fake provider's `example.yaml` it reads.

Longer than 300 lines because the two cluster kinds share their process hygiene,
environment and Serve observation helpers, which the scenario scripts import.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from specdec.net import free_port

ROOT = Path(__file__).resolve().parent.parent

FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
FAKE_HEAD_NODE_ID = "f" * 51 + "00000"  # the fake provider's head id (its own constant)

# Serve pushes autoscaling metrics every 10 s by default; a test wants them every second.
FAST_SERVE_METRICS = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def prepare_environment(extra: dict | None = None) -> None:
    """Before the first node starts: every Ray process inherits this process's environment
    (the repository on PYTHONPATH so that replicas import `deployments`)."""
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.update(extra or {})


def _node_args(**overrides) -> dict:
    args = {
        "include_dashboard": False,
        "dashboard_agent_listen_port": 0,  # not the fixed default: other Rays may hold it
        "object_store_memory": 100 * 1024 * 1024,
    }
    return args | overrides


def _session_processes(session_dir: str) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(session_dir in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _kill(procs, grace_s: float = 5.0) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.kill()


class LocalCluster:
    """A started cluster: `.address` to ray.init, `.shutdown()` (also on context exit)."""

    def __init__(self, cluster, config_path: str | None = None):
        self.cluster = cluster
        self.address = cluster.address
        self.session_dir = cluster.head_node.get_session_dir_path()
        self._config_path = config_path
        print(f"SESSION {self.session_dir}", flush=True)  # lets a supervisor clean up after a kill

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def shutdown(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        # Nodes the fake autoscaler started are not this process's; find them by session.
        leftovers = _session_processes(self.session_dir)
        with contextlib.suppress(Exception):
            self.cluster.shutdown()
        _kill([p for p in leftovers if p.is_running()])
        if self._config_path:
            with contextlib.suppress(OSError):
                os.unlink(self._config_path)


def multinode(head: dict, workers: list[dict]) -> LocalCluster:
    """head / workers: node arguments (num_cpus, resources, ...). Blocks until all are up."""
    from ray.cluster_utils import Cluster

    prepare_environment()
    cluster = Cluster(initialize_head=True, head_node_args=_node_args(gcs_server_port=free_port(), **head))
    for worker in workers:
        cluster.add_node(**_node_args(**worker))
    cluster.wait_for_nodes(timeout=60)
    return LocalCluster(cluster)


def fake_autoscaling(head_resources: dict, worker_node_types: dict, *, idle_timeout_minutes: float = 0.1,
                     env: dict | None = None) -> LocalCluster:
    """A head node (head_resources: CPU and custom resources) with an autoscaler whose node
    provider starts worker nodes of `worker_node_types` (autoscaler `available_node_types`:
    resources, min_workers, max_workers) on this machine."""
    from ray._private.services import get_node_ip_address
    from ray.cluster_utils import Cluster

    port = free_port()
    config = {
        "cluster_name": f"specdec-fake-{port}",
        "max_workers": sum(t["max_workers"] for t in worker_node_types.values()),
        "upscaling_speed": 100.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "external",
            "module": FAKE_PROVIDER,
            "gcs_address": f"{get_node_ip_address()}:{port}",
            "head_node_id": FAKE_HEAD_NODE_ID,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0},
            **{name: {"node_config": {}, **spec} for name, spec in worker_node_types.items()},
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
    fd, config_path = tempfile.mkstemp(prefix="specdec-fake-autoscaler-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    # The monitor (the autoscaler) inherits this environment; RAY_FAKE_CLUSTER lets the
    # fake provider run, AUTOSCALER_UPDATE_INTERVAL_S makes it decide every second.
    prepare_environment({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", **(env or {})})
    resources = dict(head_resources)
    cluster = Cluster(
        initialize_head=True,
        head_node_args=_node_args(
            gcs_server_port=port,
            num_cpus=resources.pop("CPU", 1),
            num_gpus=resources.pop("GPU", 0),
            resources=resources,
            autoscaling_config=config_path,
            env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        ),
    )
    return LocalCluster(cluster, config_path)


# ---- Serve observations ------------------------------------------------------------------------


def replica_states(app: str) -> dict[str, dict[str, int]]:
    """{deployment: {replica state: count}} from serve.status() (RUNNING, STARTING, ...)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {
        name: {str(getattr(state, "value", state)): n for state, n in dep.replica_states.items()}
        for name, dep in status.deployments.items()
    }


def replica_counts(app: str) -> dict[str, int]:
    """{deployment: number of RUNNING replicas} from serve.status()."""
    return {name: states.get("RUNNING", 0) for name, states in replica_states(app).items()}


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def tiny_pair(folder: str | None = None) -> tuple[Path, Path]:
    """(draft_dir, target_dir): the tests' tiny random-weight pair, made once in `folder`."""
    from specdec.model_pair import ensure_tokenizer
    from specdec.tiny import make_tiny_pair

    folder = Path(folder or Path(tempfile.gettempdir()) / "specdec-tiny-pair")
    done = folder / "pair.json"
    if done.is_file():
        draft, target = json.loads(done.read_text())
        return Path(draft), Path(target)
    folder.mkdir(parents=True, exist_ok=True)
    draft, target = make_tiny_pair(folder, ensure_tokenizer())
    done.write_text(json.dumps([str(draft), str(target)]))
    return Path(draft), Path(target)


def tiny_app_args(draft_dir, target_dir, *, batch_invariant: bool = False, **overrides) -> dict:
    """The application's args on the tiny pair (as tests/serve_fixtures.py builds them).
    `batch_invariant`: both pools' setting, which a seeded text's promise across batches and
    failovers needs."""
    runner = {"dtype": "float32", "max_batch_size": 16, "num_threads": 1,
              "batch_invariant": batch_invariant}
    return {
        "served_model_name": "tiny",
        "num_speculative_tokens": 3,
        # The tiny draft costs as much as the tiny target, so adaptive K would (rightly) pick
        # K = 0; the rehearsals and tests exercise speculation at the fixed K instead.
        "adaptive_k": False,
        "draft": {"model": str(draft_dir), **runner},
        "target": {"model": str(target_dir), **runner},
    } | overrides


def tiny_serve_app(name: str, draft_dir, target_dir, deployments: list[dict]) -> dict:
    """One entry of a Serve config's `applications:`, on the tiny pair at route "/"."""
    return {
        "name": name,
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": tiny_app_args(draft_dir, target_dir),
        "deployments": deployments,
    }


def result_line(payload: dict) -> None:
    """The one machine-readable line a test looks for in a helper's output."""
    print("RESULT " + json.dumps(payload), flush=True)
    sys.stdout.flush()


# ---- deploying a Serve config ------------------------------------------------------------------


def deploy(app: dict, *, http_port: int, timeout_s: float = 150.0):
    """Deploys one application from a Serve config dict (the `applications:` entry of a
    config file) the way `serve deploy` does (the controller applies the config), waits
    until it is RUNNING and returns its handle."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    http = {"host": "127.0.0.1", "port": http_port}
    serve.start(proxy_location="HeadOnly", http_options=http)
    schema = ServeDeploySchema.model_validate(
        {"proxy_location": "HeadOnly", "http_options": http, "applications": [app]}
    )
    _get_global_client().deploy_apps(schema)
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app["name"])
        if status is not None and status.status == "RUNNING":
            return serve.get_app_handle(app["name"])
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}")
        time.sleep(1)
    raise TimeoutError(f"application not RUNNING after {timeout_s:.0f} s: {status}")


# ---- running a scenario in its own process -----------------------------------------------------


def run_scenario(module: str, pair, *, timeout_s: float, args: tuple[str, ...] = ()) -> dict:
    """Runs `python -m <module> --draft D --target T` in a subprocess (its own Ray cluster,
    apart from any Ray this process has), echoes its log lines, and returns the payload
    of its `RESULT` line. Fails with the output's tail when it exits non-zero or times out."""
    import subprocess

    draft_dir, target_dir = pair
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("RAY_ADDRESS", None)  # never join somebody else's cluster
    command = [sys.executable, "-m", module, "--draft", str(draft_dir), "--target", str(target_dir), *args]
    # Its own process group: on a timeout everything it started goes, and nothing else.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        sessions = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("SESSION ")]
        for session in sessions:  # Ray processes that left the group (daemonised nodes)
            _kill(_session_processes(session), grace_s=2)
        raise AssertionError(f"{module} did not finish in {timeout_s:.0f} s:\n{out[-6000:]}") from None
    lines = out.splitlines()
    for line in lines:
        if line.startswith("[") and line[1:3].isdigit():  # its own timestamped log lines
            print(line)
    results = [line[len("RESULT "):] for line in lines if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise AssertionError(f"{module} exited {proc.returncode}:\n{out[-8000:]}")
    return json.loads(results[-1])
