"""Independent autoscaling of the Draft and Target pools on Ray's fake multi-node autoscaler
(cluster/local_autoscaling.py does the work; see its docstring for the load phases):
each pool scales up and back down on its own, the autoscaler adds and removes nodes of the
pool's type, and no request fails while replicas drain.

The scenario runs in a subprocess with its own Ray cluster, so it never meets the Ray
instance of the session-scoped `ray_serve` fixture (tests/serve_fixtures.py). Run with
`-s` to see the replica counts over time."""

from __future__ import annotations

import pytest

from cluster.localcluster import run_scenario

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')



def test_draft_and_target_pools_scale_independently(tiny_pair):
    result = run_scenario("cluster.local_autoscaling", tiny_pair, timeout_s=450)
    assert all(result["checks"].values()), result["checks"]
    assert result["requests_failed"] == [] and result["requests_ok"] > 0
    rows = result["timeline"]
    by_phase = lambda name: [r for r in rows if r["phase"].startswith(name)]  # noqa: E731
    # A (draft-heavy): the draft pool grows while the target pool is at one replica.
    assert any(r["draft"] == 2 and r["target"] == 1 for r in by_phase("A"))
    # B (target-only): the target pool grows while the draft pool shrinks.
    assert max(r["target"] for r in by_phase("B")) == 2
    assert by_phase("B")[-1]["draft"] == 1
    # C, D: back to one replica each, and the extra worker nodes go away.
    assert by_phase("C")[-1]["target"] == 1
    final = rows[-1]
    assert (final["draft"], final["target"], final["draft_nodes"], final["target_nodes"]) == (1, 1, 1, 1)
    # Nodes followed replicas: a second node of each type existed at some point.
    assert max(r["draft_nodes"] for r in rows) == 2 and max(r["target_nodes"] for r in rows) == 2
