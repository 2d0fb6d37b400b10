"""CallBatcher: calls that wait while a batch runs share the next one (continuous batching)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.workers import CallBatcher


class Pool:
    """A stand-in model: each batch takes `seconds`; records the batches it saw."""

    def __init__(self, seconds: float = 0.05, fail_on=None):
        self.batches: list[list[int]] = []
        self.seconds, self.fail_on = seconds, fail_on

    async def run(self, calls):
        self.batches.append(list(calls))
        await asyncio.sleep(self.seconds)
        if self.fail_on in calls:
            raise ValueError("bad call")
        return [c * 10 for c in calls]


def test_calls_arriving_during_a_batch_share_the_next_one():
    async def main():
        pool = Pool()
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.0)
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.01)  # the first batch is running now
        later = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 8)]
        return pool, await first, await asyncio.gather(*later)

    pool, first, later = asyncio.run(main())
    assert first == 0 and later == [10 * i for i in range(1, 8)]
    assert pool.batches == [[0], list(range(1, 8))]


def test_a_lone_request_in_rounds_does_not_wait_for_company():
    """A new call waits wait_s for company; the next rounds of the only caller in rounds do
    not (regrouping waits for callers in rounds, and there is none to wait for)."""

    async def main():
        pool = Pool(seconds=0.01)
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await batcher.submit(0)
        first = loop.time() - start
        for r in range(1, 4):
            await batcher.submit(r)
        return pool, first, loop.time() - start - first

    pool, first, rest = asyncio.run(main())
    assert pool.batches == [[0], [1], [2], [3]]
    assert first >= 0.5  # a new call waited for company
    assert rest < 0.5  # three rounds of 0.01 s, none of them waiting 0.5 s


def test_batches_are_bounded_and_keep_arrival_order():
    async def main():
        pool = Pool(seconds=0.01)
        batcher = CallBatcher(pool.run, max_batch_size=3, wait_s=0.01)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(7)))
        return pool, results

    pool, results = asyncio.run(main())
    assert results == [10 * i for i in range(7)]
    assert pool.batches == [[0, 1, 2], [3, 4, 5], [6]]


def test_an_error_reaches_every_caller_of_its_batch_and_no_other():
    async def main():
        pool = Pool(fail_on=2)
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.01)
        bad = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
        good = await batcher.submit(5)
        return bad, good

    bad, good = asyncio.run(main())
    assert all(isinstance(r, ValueError) for r in bad)
    assert good == 50


def test_a_cancelled_caller_is_left_out_of_the_next_batch():
    async def main():
        pool = Pool()
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.0)
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return pool, await first, await kept

    pool, first, kept = asyncio.run(main())
    assert (first, kept) == (0, 20)
    assert pool.batches == [[0], [2]]


@pytest.mark.parametrize("requests, gap_s", [(4, 0.004), (8, 0.006)])
def test_a_batch_waits_briefly_for_the_rest_of_the_last_batch(requests, gap_s):
    """Requests in rounds, each sending its next call a few ms after the one before it (a
    coordinator gets to each result in turn): every round after the first is one batch. At
    eight, 42 ms from first to last is more than a quarter of the 100 ms pass, yet each
    arrival shows the rest are on their way."""

    async def request(batcher, i, rounds):
        for r in range(rounds):
            await batcher.submit(i)
            await asyncio.sleep(gap_s * i)

    async def main():
        pool = Pool(seconds=0.1)
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.01)
        await asyncio.gather(*(request(batcher, i, 4) for i in range(requests)))
        return pool

    pool = asyncio.run(main())
    assert [len(b) for b in pool.batches] == [requests] * 4


def test_a_departed_request_costs_one_bounded_wait():
    async def main():
        pool = Pool(seconds=0.1)
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.0)
        await asyncio.gather(*(batcher.submit(i) for i in range(4)))
        loop = asyncio.get_running_loop()
        start = loop.time()
        await batcher.submit(9)  # only one of the four comes back
        return pool, loop.time() - start

    pool, took = asyncio.run(main())
    assert pool.batches[-1] == [9]
    assert took < 0.1 + min(CallBatcher.REGROUP * 0.1, CallBatcher.REGROUP_MAX_S) + 0.05


def test_two_alternating_groups_merge_into_one_batch():
    """Eight requests in rounds, four of them one batch behind the others (they drafted
    first): the groups merge instead of alternating for good."""

    async def request(batcher, i, rounds, delay):
        await asyncio.sleep(delay)
        for r in range(rounds):
            await batcher.submit(i)
            await asyncio.sleep(0.002)  # the caller's own processing time

    async def main():
        pool = Pool(seconds=0.1)
        batcher = CallBatcher(pool.run, max_batch_size=16, wait_s=0.0)
        early = [request(batcher, i, 10, 0.0) for i in range(4)]
        late = [request(batcher, i, 10, 0.05) for i in range(4, 8)]
        await asyncio.gather(*early, *late)
        return pool

    pool = asyncio.run(main())
    sizes = [len(b) for b in pool.batches]
    assert sum(sizes) == 80 and sizes.count(8) >= 5, sizes  # 9 at best
