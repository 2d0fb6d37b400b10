"""A Target replica spanning two ranks (gloo on CPU, the code path NCCL takes on GPUs):
one Serve replica, a placement group of two bundles, rank 1 an actor in bundle 1."""

from __future__ import annotations

import pytest
from ray import serve

from serve_fixtures import tiny_app_args

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')


APP = "tp2"


@pytest.fixture(scope="module")
def tp_handle(ray_serve, tiny_pair):
    from deployments.app import build_app

    args = tiny_app_args(tiny_pair, served_model_name=APP)
    args["target"] |= {"tensor_parallel_size": 2}
    args["target_options"] = {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 1},
        "placement_group_bundles": [{"CPU": 1}, {"CPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
    }
    handle = serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield handle
    serve.delete(APP)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "seed": 17, "max_tokens": 24, "ignore_eos": True},
    ],
    ids=["greedy", "seeded"],
)
def test_two_rank_target_gives_the_single_rank_output(tp_handle, serve_tiny_app, params):
    request = {"prompt": "class LinkedList:", "sampling_params": params}
    sharded = tp_handle.generate.remote(request).result()
    single = serve_tiny_app.generate.remote(request).result()
    assert sharded.token_ids == single.token_ids
    assert sharded.speculation.proposed > 0
