"""Pools on one CPU node take turns on its cores (deployments.node_cores), and a batch that
waits for missing callers keeps waiting while another pool's pass holds them."""

from __future__ import annotations

import asyncio
import threading

from deployments.config import RunnerConfig
from deployments.node_cores import NodeCores
from deployments.workers import CallBatcher


def test_cpu_pools_take_turns_by_default_and_gpu_pools_do_not():
    assert RunnerConfig(model="m").takes_turns_on_cores()
    assert not RunnerConfig(model="m", device="cuda:1").takes_turns_on_cores()
    assert not RunnerConfig(model="m", exclusive_cores=False).takes_turns_on_cores()
    assert not NodeCores(False).enabled and not NodeCores(False).taken_by_another()


def test_a_pass_holds_the_cores_against_every_other_replica(tmp_path):
    """Two replicas (two open files of the node's lock, as two processes hold): while one
    runs a pass the other sees the cores taken and its own pass waits for them."""
    draft, target = NodeCores(True, tmp_path / "cores.lock"), NodeCores(True, tmp_path / "cores.lock")
    assert not target.taken_by_another()
    entered, leave = threading.Event(), threading.Event()

    def target_pass():
        with target.turn():
            entered.set()
            leave.wait(5)

    waiter = threading.Thread(target=target_pass)
    with draft.turn():
        assert target.taken_by_another()
        waiter.start()
        assert not entered.wait(0.2)  # blocked while the draft's pass runs
    assert entered.wait(5)  # and runs once it ends
    assert draft.taken_by_another()
    leave.set()
    waiter.join()
    assert not draft.taken_by_another() and not target.taken_by_another()


class TakingTurns:
    """Two stand-in pools on shared cores: one pass at a time, `seconds` each."""

    def __init__(self, seconds: float):
        self.cores = asyncio.Lock()
        self.seconds = seconds
        self.batches: dict[str, list[int]] = {"draft": [], "target": []}

    def pool(self, name: str):
        async def run(calls):
            async with self.cores:
                self.batches[name].append(len(calls))
                await asyncio.sleep(self.seconds)
            return list(calls)
        return run


def run_rounds(aware: bool) -> dict[str, list[int]]:
    """Eight requests in draft -> score rounds, arriving in three groups 30 ms apart (as
    over HTTP: the first ones draft their first round before the others arrive)."""

    async def request(draft, target, i, delay):
        await asyncio.sleep(delay)
        for _ in range(12):
            await draft.submit(i)
            await asyncio.sleep(0.002)  # the coordinator's accept step
            await target.submit(i)
            await asyncio.sleep(0.002)

    async def main():
        node = TakingTurns(seconds=0.06)
        busy = node.cores.locked if aware else (lambda: False)
        draft = CallBatcher(node.pool("draft"), max_batch_size=16, wait_s=0.0, cores_busy=busy)
        target = CallBatcher(node.pool("target"), max_batch_size=16, wait_s=0.0, cores_busy=busy)
        await asyncio.gather(*(request(draft, target, i, 0.03 * (i % 3)) for i in range(8)))
        return node.batches

    return asyncio.run(main())


def test_rounds_regroup_while_the_other_pool_holds_the_cores():
    aware = run_rounds(aware=True)
    assert sum(aware["target"]) == 96
    assert aware["target"].count(8) >= 9, aware  # 11 at best: the first rounds gather
    assert len(aware["target"]) <= 16, aware


def test_without_looking_at_the_cores_the_groups_stay_apart():
    """The control: the same rounds with a batcher that does not look at the cores."""
    blind = run_rounds(aware=False)
    assert sum(blind["target"]) == 96
    assert blind["target"].count(8) <= 2 and len(blind["target"]) >= 18, blind
