"""Fixtures that start one local Ray instance and Serve applications on it (loaded by
conftest.py as a plugin)."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_serve():
    """A local Ray with Serve's HTTP proxy on a free loopback port; yields the base URL."""
    import ray
    from ray import serve

    # address="local": always a fresh instance, never a cluster another process started.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def tiny_app_args(tiny_pair, **overrides) -> dict:
    draft_dir, target_dir = tiny_pair
    runner = {"dtype": "float32", "max_batch_size": 16, "num_threads": 1}
    return {
        "served_model_name": "tiny",
        "num_speculative_tokens": 3,
        "draft": {"model": str(draft_dir), **runner},
        "target": {"model": str(target_dir), **runner},
    } | overrides


@pytest.fixture(scope="session")
def serve_tiny_app(ray_serve, tiny_pair):
    """The whole application on the tiny pair at route '/'; yields the Coordinator handle."""
    from ray import serve

    from deployments.app import build_app

    handle = serve.run(build_app(tiny_app_args(tiny_pair)), name="tiny", route_prefix="/")
    yield handle
    serve.delete("tiny")
