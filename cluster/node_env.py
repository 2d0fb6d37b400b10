"""The Ray / Serve environment of a CPU serving node (cluster/cpu_node.env), for the Python
launchers; `./run.sh serve` reads the same file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CPU_NODE_ENV = Path(__file__).resolve().parent / "cpu_node.env"


def read_env_file(path: Path = CPU_NODE_ENV) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
            pairs[key.strip()] = value.strip()
    return pairs


def cpu_node_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the file's settings added where
    `base` does not set them: a user's own value wins."""
    env = dict(os.environ if base is None else base)
    for key, value in read_env_file().items():
        env.setdefault(key, value)
    return env
