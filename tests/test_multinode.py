"""Multi-node placement on one machine: a head plus a `draft_node` and a `target_node`
worker (ray.cluster_utils.Cluster), the app deployed from a Serve config with the GPU
profile's placement shape on the tiny pair; each pool must land on its node and requests
must be served across them (cluster/local_multinode.py does the work).

The scenario runs in a subprocess with its own Ray cluster, so it never meets the Ray
instance of the session-scoped `ray_serve` fixture (tests/serve_fixtures.py)."""

from __future__ import annotations

import pytest

from cluster.localcluster import run_scenario

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')



def test_pools_land_on_their_nodes_and_serve_across_nodes(tiny_pair):
    result = run_scenario("cluster.local_multinode", tiny_pair, timeout_s=240)
    assert all(result["checks"].values()), result["checks"]
    placement = result["placement"]
    assert sorted(placement["nodes"].values()) == ["draft", "head", "target"]
    nodes_of = {name: {r["node"] for r in replicas} for name, replicas in placement["replicas"].items()}
    assert nodes_of == {"Coordinator": {"head"}, "Draft": {"draft"}, "Target": {"target"}}
    (group,) = [g for g in placement["placement_groups"] if g["bundles"][0]["resources"].get("target_node")]
    assert group["strategy"] == "STRICT_PACK"
    assert [b["node"] for b in group["bundles"]] == ["target", "target"]
