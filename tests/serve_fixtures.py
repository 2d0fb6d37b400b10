"""Fixtures that start one local Ray instance and Serve applications on it (loaded by
conftest.py as a plugin)."""

from __future__ import annotations

import pytest

from cluster import localcluster
from specdec.net import free_port


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
    """The application's args on the tiny pair (cluster/localcluster.py builds them;
    batch_invariant=True sets both pools)."""
    return localcluster.tiny_app_args(*tiny_pair, **overrides)


@pytest.fixture(scope="session")
def serve_tiny_app(ray_serve, tiny_pair):
    """The whole application on the tiny pair at route '/'; yields the Coordinator handle."""
    from ray import serve

    from deployments.app import build_app

    handle = serve.run(build_app(tiny_app_args(tiny_pair)), name="tiny", route_prefix="/")
    yield handle
    serve.delete("tiny")
