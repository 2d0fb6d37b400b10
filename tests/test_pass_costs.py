"""Whole-pass costs timed at load (specdec.pass_costs), on the tiny pair."""

import asyncio
from types import SimpleNamespace

from specdec.pass_costs import PASS_ROWS, with_pass_costs
from specdec.runner import ModelRunner


def test_both_runners_time_their_round_functions_and_keep_no_cache(tiny_pair):
    draft_dir, target_dir = tiny_pair
    draft = ModelRunner(draft_dir, dtype="float32", batch_invariant=True, draft=True)
    target = ModelRunner(target_dir, dtype="float32", batch_invariant=True)
    draft_cal = with_pass_costs(draft, draft=True)
    target_cal = with_pass_costs(target, draft=False)
    for cal in (draft_cal, target_cal):
        assert set(cal["pass_ms"]) == set(PASS_ROWS) and min(cal["pass_ms"].values()) > 0
        assert cal["forward_ms"]  # the calibration's own report stays
    assert draft_cal["prefill_row_ms"] > 0 and "prefill_row_ms" not in target_cal
    assert draft.cache_usage()["sequences"] == target.cache_usage()["sequences"] == 0


def test_a_runner_that_measured_no_matmuls_is_not_timed():
    """GPUs report no matmul table: K stays as configured there, so nothing is timed."""
    runner = SimpleNamespace(calibration=lambda: {"forward_ms": {}, "format": "bfloat16"})
    assert with_pass_costs(runner, draft=False) == {"forward_ms": {}, "format": "bfloat16"}


def test_the_in_process_engine_prices_whole_passes(tiny_pair):
    from specdec.local import LocalEngine

    engine = LocalEngine(*tiny_pair, dtype="float32", batch_invariant=True, adaptive_k=True)
    costs = engine.info.k_costs
    assert costs.pass_rows == PASS_ROWS and costs.draft_prefill_row_ms > 0


class LoadingPool:
    """A Serve handle's shape for one pool that answers once it has loaded (as a replica
    still in __init__ does); `calibration` records whether the other pool had loaded."""

    def __init__(self, loaded, other_loaded):
        self.loaded, self.other_loaded, self.timed_beside_a_load = loaded, other_loaded, None
        self.cache_usage = SimpleNamespace(remote=self._answer)
        self.calibration = SimpleNamespace(remote=self._calibrate)

    async def _answer(self):
        await self.loaded.wait()
        return {}

    async def _calibrate(self):
        await self.loaded.wait()
        self.timed_beside_a_load = not self.other_loaded.is_set()
        return {"forward_ms": {}}


def test_the_coordinator_has_passes_timed_only_once_both_pools_have_loaded():
    """The first request may reach the coordinator while the draft still loads: the
    target must not time its passes beside that load."""
    from deployments.config import AppConfig
    from deployments.coordinator import Coordinator

    async def main():
        draft_loaded, target_loaded = asyncio.Event(), asyncio.Event()
        target_loaded.set()
        draft = LoadingPool(draft_loaded, target_loaded)
        target = LoadingPool(target_loaded, draft_loaded)
        coordinator = SimpleNamespace(
            config=AppConfig(), draft=draft, target=target, info=SimpleNamespace(),
            _k_costs_lock=asyncio.Lock(), _k_costs_loaded=False,
        )
        asyncio.get_running_loop().call_later(0.05, draft_loaded.set)
        await Coordinator.func_or_class._load_k_costs(coordinator)
        return draft, target

    draft, target = asyncio.run(main())
    assert (draft.timed_beside_a_load, target.timed_beside_a_load) == (False, False)
