"""Cache-affinity routing for the Draft and Target pools.

Every round of a request (and its final `release`) goes to the replica that rendezvous
hashing picks for its request id, so the replica that holds the request's KV cache gets
it back and nothing is re-prefilled. The other replicas follow as lower ranks: when the
preferred one is full or gone, Serve takes the next, and that replica re-prefills from
the token list the call carries. Affinity is a speed-up only; correctness never
depends on it.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def request_key(pending: PendingRequest | None) -> str | None:
    """The request id a call is about: a DraftCall / ScoreCall's, or release's argument."""
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, str) else getattr(first, "request_id", None)


def rank(key: str, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Rendezvous (highest random weight) order: stable as replicas come and go."""

    def weight(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{key}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


class CacheAffinityRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = request_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        return [[replica] for replica in rank(key, candidate_replicas)]
