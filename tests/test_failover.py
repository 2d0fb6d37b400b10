"""Replica failures and redeploys under traffic (tiny pair): no request fails, and seeded
texts stay what they were without the fault (the pools run with batch_invariant, which that
promise needs: a failed-over request re-prefills on another replica beside other requests).

Faults are injected by SIGKILL of the replica's process while requests stream."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from ray import serve

from serve_fixtures import tiny_app_args

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')


APP = "failover"


@pytest.fixture(scope="module")
def failover_handle(ray_serve, tiny_pair):
    from deployments.app import build_app

    args = tiny_app_args(
        tiny_pair,
        served_model_name=APP,
        batch_invariant=True,  # the unchanged-seeded-text promise below needs it
        draft_options={"num_replicas": 1},
        target_options={
            "num_replicas": 2,
            "request_router_config": {"request_router_class": "deployments.routing:CacheAffinityRouter"},
        },
        coordinator_options={"num_replicas": 1},
    )
    handle = serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield handle
    serve.delete(APP)


def requests(n: int = 6) -> list[dict]:
    return [
        {
            "prompt": f"def task_{i}(x):" + " pass" * i,
            "sampling_params": {
                "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "max_tokens": 120,
                "ignore_eos": True, "drafter_invariant": i % 2 == 1,
            },
        }
        for i in range(n)
    ]


def replica_pids(deployment: str) -> list[int]:
    actors = ray._private.state.actors().values()
    return [
        a["Pid"] for a in actors
        if a["State"] == "ALIVE" and f"{APP}#{deployment}" in (a.get("Name") or "")
    ]


def stream_all(handle, reqs, fault=None) -> list[list[int]]:
    """Stream every request in its own thread; call `fault` once all have started."""
    outputs: list[list[int]] = [[] for _ in reqs]
    errors: list[BaseException] = []
    started = threading.Barrier(len(reqs) + 1, timeout=120)

    def consume(i: int) -> None:
        try:
            first = True
            for delta in handle.options(stream=True).generate_stream.remote(reqs[i]):
                outputs[i] += delta.token_ids
                if first:
                    first = False
                    started.wait()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    started.wait()
    if fault is not None:
        fault()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return outputs


def kill_one(deployment: str) -> None:
    pids = replica_pids(deployment)
    assert pids, f"no live {deployment} replica found"
    os.kill(pids[0], signal.SIGKILL)
    print(f"killed {deployment} replica pid {pids[0]} of {pids}")


@pytest.mark.parametrize("deployment", ["Draft", "Target"])
def test_replica_killed_mid_generation(failover_handle, deployment):
    reqs = requests()
    reference = stream_all(failover_handle, reqs)
    assert all(len(o) == 120 for o in reference)
    faulty = stream_all(failover_handle, reqs, fault=lambda: kill_one(deployment))
    changed = sum(a != b for a, b in zip(reference, faulty))
    print(f"{deployment} killed: failed 0 of {len(reqs)}, seeded texts changed {changed} of {len(reqs)}")
    assert changed == 0
    deadline = time.time() + 60  # Serve replaces the replica
    while len(replica_pids(deployment)) < (1 if deployment == "Draft" else 2) and time.time() < deadline:
        time.sleep(1)


def test_redeploy_under_traffic(failover_handle, tiny_pair):
    """A new configuration (default K, replica counts) while requests stream: none fail."""
    from deployments.app import build_app

    args = tiny_app_args(
        tiny_pair,
        served_model_name=APP,
        num_speculative_tokens=2,
        draft_options={"num_replicas": 1},
        target_options={"num_replicas": 1},
        coordinator_options={"num_replicas": 1},
    )

    def redeploy() -> None:
        serve.run(build_app(args), name=APP, route_prefix=f"/{APP}", blocking=False)

    outputs = stream_all(failover_handle, requests(), fault=redeploy)
    assert all(len(o) == 120 for o in outputs)
