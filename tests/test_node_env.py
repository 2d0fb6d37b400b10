"""cluster/cpu_node.env: the Ray / Serve settings `./run.sh serve` and scripts/serve_speed.py
give a CPU serving node. Ray ignores an environment variable it does not know, so a
misspelt name would silently change nothing: every name must be one the installed Ray
reads. And `./run.sh serve` must hand them to `serve run`, a value from the shell winning."""

from __future__ import annotations

import inspect
import os
import stat
import subprocess
from pathlib import Path

import ray
import ray._private.ray_constants as ray_constants
import ray.serve._private.constants as serve_constants

from cluster.node_env import CPU_NODE_ENV, cpu_node_env, read_env_file

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_is_a_variable_the_installed_ray_reads():
    env = read_env_file()
    assert env, "no settings read"
    known = inspect.getsource(ray_constants) + inspect.getsource(serve_constants)
    for key, value in env.items():
        assert f'"{key}"' in known, f"{key} is not read by Ray {ray.__version__}"
        float(value)  # all of them are numbers


def test_a_value_from_the_environment_wins():
    key, value = next(iter(read_env_file().items()))
    assert cpu_node_env({})[key] == value
    assert cpu_node_env({key: "7"})[key] == "7"
    assert cpu_node_env({"OTHER": "x"})["OTHER"] == "x"


def _fake_venv(tmp_path: Path) -> Path:
    """A venv whose python succeeds at every set-up step and whose `serve` prints the
    environment it was started with: ./run.sh serve's set-up runs, but nothing installs."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("python", "exit 0"), ("serve", 'echo "ARGS $*"; env')):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "venv"


def _run_serve(venv: Path, **env) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in read_env_file()}
    out = subprocess.run(["bash", str(ROOT / "run.sh"), "serve"], check=True, text=True,
                         capture_output=True, env=base | {"SPECDEC_VENV": str(venv)} | env).stdout
    lines = out.splitlines()
    assert lines[0] == "ARGS run ray_config.yaml"
    return dict(line.split("=", 1) for line in lines[1:] if "=" in line)


def test_run_sh_serve_starts_serve_run_with_the_node_settings(tmp_path):
    venv = _fake_venv(tmp_path)
    settings = read_env_file(CPU_NODE_ENV)
    got = _run_serve(venv)
    assert {k: got.get(k) for k in settings} == settings
    key = next(iter(settings))
    assert _run_serve(venv, **{key: "7"})[key] == "7"
