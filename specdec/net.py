"""A free TCP port: for test clusters, local tools, and the tensor-parallel rendezvous."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" = every interface, for peers on other addresses)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
