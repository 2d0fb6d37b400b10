"""The README's cluster path, as a user runs it: `ray start --head`, then
`serve deploy ray_config.yaml`, on a machine where `./run.sh serve` ran before.

Ray 2.60 writes a token to ~/.ray/auth_token the first time it starts a local cluster
(`serve run`); from then on `ray start --head` turns token authentication on, and a
`serve deploy` that does not know it is refused ("Authentication required"). The README
has them run with `RAY_AUTH_MODE=token` exported, after `ray get-auth-token --generate`
(which makes a token only where there is none); this test runs those commands in a private
home folder, with the token `serve run` left and on a fresh one, on the tiny pair, and then
uses the service the three ways
the README shows: the Python handle, streaming chat through the `openai` client, and the
`ray_specdec_*` metrics. The cluster is private (its own ports and temp folder) and only
its own processes are stopped afterwards: never `ray stop`.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from cluster.localcluster import _kill, _session_processes, tiny_app_args
from cluster.node_env import read_env_file
from specdec.net import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _serve_config(draft_dir, target_dir, http_port: int) -> dict:
    """ray_config.yaml as shipped, with the tiny pair and a free HTTP port."""
    config = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    (app,) = config["applications"]
    app["args"] = tiny_app_args(draft_dir, target_dir, served_model_name=app["args"]["served_model_name"])
    return config


def _run(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _wait_for(what: str, check, timeout_s: float, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # not up yet
            last = exc
        else:
            last = None
        assert time.monotonic() < deadline, f"{what} not ready after {timeout_s} s ({last})"
        time.sleep(every_s)


@pytest.fixture(scope="module", params=["after ./run.sh serve", "fresh machine"])
def deployed(request, tiny_pair):
    """The README's commands, in a home that holds the token `serve run` left, or none."""
    home = Path(tempfile.mkdtemp(prefix="rs-home-"))
    token = home / ".ray" / "auth_token"
    if request.param == "after ./run.sh serve":
        token.parent.mkdir()
        token.write_text(secrets.token_hex(16))
    before = token.read_text() if token.exists() else None
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths
    ports = {name: free_port() for name in ("gcs", "dashboard", "agent", "metrics", "http")}
    env = os.environ | read_env_file() | {  # the README's `. cluster/cpu_node.env`
        "HOME": str(home),
        "RAY_AUTH_MODE": "token",  # the README's `export RAY_AUTH_MODE=token`
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DASHBOARD_ADDRESS": f"http://127.0.0.1:{ports['dashboard']}",  # serve deploy's default
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    config_path = Path(temp_dir) / "ray_config.yaml"
    config_path.write_text(yaml.safe_dump(_serve_config(*tiny_pair, ports["http"])))
    try:
        _run([str(BIN / "ray"), "get-auth-token", "--generate"], env)
        assert before is None or token.read_text() == before  # an existing token is kept
        _run([str(BIN / "ray"), "start", "--head", f"--port={ports['gcs']}", "--num-cpus=4",
              f"--metrics-export-port={ports['metrics']}", f"--temp-dir={temp_dir}",
              "--include-dashboard=true", f"--dashboard-port={ports['dashboard']}",
              f"--dashboard-agent-listen-port={ports['agent']}", "--disable-usage-stats"], env)
        _run([str(BIN / "serve"), "deploy", str(config_path)], env)
        base = f"http://127.0.0.1:{ports['http']}"
        _wait_for("the application", lambda: urllib.request.urlopen(f"{base}/health", timeout=5).status == 200, 300, 2)
        yield {"env": env, "base": base, "ports": ports}
    finally:
        _kill(_session_processes(temp_dir))


def test_serve_deploy_works_with_token_authentication(deployed):
    # The Python handle, from a driver that connects as the README's users do.
    driver = (
        "import ray; from ray import serve\n"
        f"ray.init(address='127.0.0.1:{deployed['ports']['gcs']}', log_to_driver=False)\n"
        "handle = serve.get_app_handle('specdec')\n"
        "r = handle.generate.remote('def fibonacci(n):', {'max_tokens': 8, 'seed': 42}).result()\n"
        "print('RESULT', r.seed, r.usage.completion_tokens)\n"
    )
    out = _run([sys.executable, "-c", driver], deployed["env"]).stdout
    assert "RESULT 42 8" in out, out

    # Streaming chat through the openai client, on the loopback address ray_config.yaml
    # keeps (host 127.0.0.1) and with no API key required (the default).
    assert yaml.safe_load((ROOT / "ray_config.yaml").read_text())["http_options"]["host"] == "127.0.0.1"
    client = openai.OpenAI(base_url=f"{deployed['base']}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="specdec-qwen2.5-coder", messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=6, seed=7, stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["seed"] == 7

    # The coordinator's metrics, on the head's metrics port.
    def metrics() -> bool:
        url = f"http://127.0.0.1:{deployed['ports']['metrics']}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return "ray_specdec_emitted_tokens" in text

    _wait_for("ray_specdec_* metrics", metrics, 90, 3)
