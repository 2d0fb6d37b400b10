"""Cache-affinity routing: a request's calls rank the replicas the same way every time,
and losing a replica moves only the requests it held."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deployments.routing import CacheAffinityRouter, rank, request_key
from specdec.rounds import ScoreCall


def replicas(n: int) -> list:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"r{i}")) for i in range(n)]


def test_calls_and_releases_of_a_request_share_a_key():
    call = ScoreCall("req-1", [1, 2], 0, sampling=None)
    assert request_key(SimpleNamespace(args=[call])) == "req-1"
    assert request_key(SimpleNamespace(args=["req-1"])) == "req-1"
    assert request_key(SimpleNamespace(args=[])) is None


def test_rendezvous_order_is_stable_and_spreads_requests():
    pool = replicas(4)
    firsts = [rank(f"req-{i}", pool)[0].replica_id.unique_id for i in range(400)]
    assert firsts == [rank(f"req-{i}", list(reversed(pool)))[0].replica_id.unique_id for i in range(400)]
    counts = {r: firsts.count(r) for r in set(firsts)}
    assert len(counts) == 4 and min(counts.values()) > 60  # roughly even


def test_losing_a_replica_moves_only_its_requests():
    pool = replicas(4)
    before = {i: rank(f"req-{i}", pool)[0] for i in range(400)}
    survivors = pool[1:]
    after = {i: rank(f"req-{i}", survivors)[0] for i in range(400)}
    moved = [i for i in before if before[i] is not after[i]]
    assert moved and all(before[i] is pool[0] for i in moved)


def test_router_returns_one_replica_per_rank():
    router = CacheAffinityRouter.__new__(CacheAffinityRouter)  # no Serve internals needed
    pool = replicas(3)
    ranks = asyncio.run(router.choose_replicas(pool, SimpleNamespace(args=["req-9"])))
    assert [r[0] for r in ranks] == rank("req-9", pool)
    assert asyncio.run(router.choose_replicas(pool, None)) == [pool]
