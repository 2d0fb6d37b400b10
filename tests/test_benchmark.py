"""Smoke test of the benchmark (benchmarks/) on the tiny pair, with tiny settings.

Checks the report's structure (JSON, Markdown, plots) and that the guard against
fast-but-wrong fires on a deliberately broken setting (the as-is arm: raw target
probabilities) while passing the fixed one."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from benchmarks.__main__ import main, parse_args
from benchmarks.guard import compare
from benchmarks.run import parse_setting
from specdec import kernels
from benchmarks.stats import (
    alpha_from_mean_accepted,
    chi2_sf,
    goodness_of_fit,
    tokens_per_round,
    two_sample_chi2,
)


def test_stats_helpers():
    assert chi2_sf(0.0, 3) == pytest.approx(1.0)
    assert chi2_sf(7.815, 3) == pytest.approx(0.05, abs=1e-3)  # the textbook 95 % quantile
    assert tokens_per_round(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert tokens_per_round(1.0, 4) == 5.0
    a = alpha_from_mean_accepted(0.8 + 0.64 + 0.512, 3)
    assert a == pytest.approx(0.8, abs=1e-6)
    same = two_sample_chi2(Counter(a=50, b=50), Counter(a=52, b=48))
    assert same["p_value"] > 0.5
    diff = two_sample_chi2(Counter(a=90, b=10), Counter(a=10, b=90))
    assert diff["p_value"] < 1e-10
    assert goodness_of_fit(Counter(a=3, c=1), {"a": 0.5, "b": 0.5})["p_value"] == 0.0


def test_settings_parse():
    assert parse_setting("greedy").params == {"temperature": 0.0}
    s = parse_setting("t0.6p0.9")
    assert s.params == {"temperature": 0.6, "top_p": 0.9} and s.label == "T=0.6 top_p=0.9"
    assert parse_setting("t1.0k20").params == {"temperature": 1.0, "top_k": 20}
    with pytest.raises(ValueError):
        parse_setting("hot")
    args = parse_args(["--quick", "--ks", "2"])
    assert args.ks == [2] and args.max_tokens == 32
    assert parse_args([]).max_tokens == 40
    assert parse_args(["--full"]).max_tokens == 128


def test_guard_compare_flags_a_wrong_sample():
    def outs(pieces_list):
        return [SimpleNamespace(pieces=p) for p in pieces_list]

    ref = outs([["1", "2"]] * 60 + [["3", "4"]] * 60)
    good = outs([["1", "2"]] * 58 + [["3", "4"]] * 62)
    bad = outs([["1", "2"]] * 100 + [["3", "4"]] * 20)
    exact = {"1": 0.5, "3": 0.5}
    assert not compare(ref, good, 2, exact, alpha=1e-3)["mismatch"]
    assert compare(ref, bad, 2, exact, alpha=1e-3)["mismatch"]


def test_benchmark_smoke(tiny_pair, tmp_path):
    draft, target = tiny_pair
    out = tmp_path / "bench"
    rc = main([
        "--draft", str(draft), "--target", str(target), "--out", str(out),
        "--ks", "2", "--settings", "greedy,t0.6p0.9", "--raw-settings", "t0.6p0.9",
        "--concurrency", "1,2", "--batched-settings", "all", "--batched-as-is",
        "--max-tokens", "6", "--num-prompts", "2",
        "--datasets", "humaneval,prose",
        "--guard-n", "32", "--guard-k", "2", "--guard-tokens", "2", "--guard-concurrency", "32",
        "--hf-prompts", "1", "--hf-settings", "greedy", "--no-progress",
        "--shipped-prompts", "2", "--shipped-batch", "2", "--shipped-tokens", "6",
        "--shipped-settings", "greedy,t0.6p0.9",
    ])
    report = json.loads((out / "results.json").read_text())
    assert rc == 0, report["verdict"]

    shipped = report["shipped"]  # ray_config.yaml's configuration, invariant and not
    assert shipped["config"]["batch_invariant"] is True and shipped["config"]["adaptive_k"] is True
    assert shipped["calibration"]["target"]["format"] in kernels.FORMATS
    assert shipped["calibration"]["k_costs"]["draft_ms"] > 0
    modes = {(r["batch_invariant"], r["setting"], r["concurrency"], r["mode"]) for r in shipped["rows"]}
    for inv in (True, False):
        for c in (1, 2):
            for mode in ("target-only", "speculative"):
                assert (inv, "greedy", c, mode) in modes
    # the shipped default mode is drafter-invariant; the standard mode runs beside it
    assert shipped["config"]["drafter_invariant"] is True
    assert {(True, "t0.6p0.9", c, "standard") for c in (1, 2)} <= modes
    for r in shipped["rows"]:
        assert r["tokens"] == r["requests"] * 6 and r["speedup"] > 0
        if r["batch_invariant"] and r["mode"] == "speculative":
            # greedy, and drafter-invariant sampled text: the target-only text of the seed
            assert r["same_text"] == r["requests"], r
    # the shipped draft's pruned vocabulary head against the whole head, same engine
    assert shipped["config"]["proposal_vocab"] > 65536  # plus the special tokens
    vocab_rows = shipped["proposal_vocab_rows"]
    assert {(r["setting"], r["proposal_vocab"]) for r in vocab_rows} == {("greedy", "whole"), ("t0.6p0.9", "whole")}
    for r in vocab_rows:
        assert r["tokens"] == r["requests"] * 6 and r["vs_shipped_draft"] > 0
        assert r["same_text"] == r["requests"]  # greedy, and the drafter-invariant default

    cells = report["cells"]
    keys = {(c["setting"], c["mode"], c["k"], c["concurrency"]) for c in cells}
    for conc in (1, 2):
        assert ("greedy", "target-only", 0, conc) in keys
        assert ("greedy", "fixed", 2, conc) in keys
        assert ("greedy", "as-is", 2, conc) not in keys  # raw mode is skipped for greedy
        for mode in ("target-only", "fixed", "as-is"):
            assert ("t0.6p0.9", mode, 0 if mode == "target-only" else 2, conc) in keys
    for c in cells:
        assert c["tokens"] == c["requests"] * 6  # fixed length: min_tokens = max_tokens
        assert c["tokens_per_s"] > 0 and c["speedup"] > 0
        assert c["by_dataset"].keys() == {"humaneval", "prose"}
        assert c["target_passes"] > 0 and c["bandwidth_gbps"] > 0
        if c["mode"] == "target-only":
            assert c["speedup"] == 1.0 and c["draft_passes"] == 0
        else:
            assert 0.0 <= c["alpha"] <= 1.0
            assert 0.0 <= c["overlap_tested"] <= 1.0
            assert abs(c["overlap_z"]) < 4  # measured acceptance agrees with Σ min(p, q)
            assert c["tokens_per_round_analytic"] == pytest.approx(
                tokens_per_round(c["alpha"], c["k"]))
            assert c["system_efficiency"] == pytest.approx(
                c["emitted"] / (c["rounds"] + c["proposed"]))
    greedy = next(c for c in cells if c["setting"] == "greedy" and c["mode"] == "fixed")
    assert greedy["overlap_z"] == 0.0  # greedy acceptance is exactly argmax agreement

    guard = report["guard"]
    assert guard["n_per_arm"] == 32 and guard["exact_first_probs"]
    assert not guard["fixed_mismatch"]  # the correct sampler passes
    assert guard["arms"]["as-is"]["mismatch"]  # the deliberately broken one is flagged
    assert guard["control_detected"] is True
    assert report["verdict"]["ok"]

    hf = report["transformers"]["rows"]
    assert {(r["setting"], r["mode"]) for r in hf} == {("greedy", "target-only"),
                                                        ("greedy", "assisted")}
    assert all(r["tokens"] == 6 for r in hf)

    md = (out / "report.md").read_text()
    assert "| K | acceptance as-is | acceptance fixed | system efficiency as-is" in md
    assert "## The shipped configuration (ray_config.yaml, in process)" in md
    assert "MISMATCH (control: must be flagged)" in md
    for png in ("acceptance_vs_k.png", "tokens_per_s_vs_k.png", "asis_vs_fixed.png"):
        assert (out / png).stat().st_size > 1000


class _EngineBackend:
    """deployments.http.Backend over the in-process engine (one request at a time)."""

    def __init__(self, engine, name: str):
        import threading

        self.engine, self.model_name = engine, name
        self.max_context = engine.info.max_context
        self.lock = threading.Lock()

    async def generate(self, request):
        import anyio

        def run():
            with self.lock:
                return self.engine.generate([request], batch_size=1)[0]

        return await anyio.to_thread.run_sync(run)


def test_benchmark_over_http(tiny_pair, tmp_path):
    """--url: the same sweep through a running app's OpenAI API (uvicorn in a thread)."""
    import threading
    import time

    import uvicorn

    from deployments.http import make_app
    from specdec.local import LocalEngine

    draft, target = tiny_pair
    app = make_app(_EngineBackend(LocalEngine(draft, target), "tiny"))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not srv.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = srv.servers[0].sockets[0].getsockname()[1]
        out = tmp_path / "bench-http"
        rc = main([
            "--url", f"http://127.0.0.1:{port}", "--draft", str(draft), "--target", str(target),
            "--out", str(out), "--ks", "2", "--settings", "t0.6p0.9", "--raw-settings", "all",
            "--concurrency", "2", "--batched-as-is", "--max-tokens", "4", "--num-prompts", "2",
            "--guard-n", "24", "--guard-k", "2", "--guard-tokens", "2",
            "--guard-concurrency", "4", "--no-progress",
        ])
    finally:
        srv.should_exit = True
        thread.join(5)
    report = json.loads((out / "results.json").read_text())
    assert rc == 0, report["verdict"]
    assert report["engine"]["backend"] == "http"
    modes = {(c["mode"], c["k"]) for c in report["cells"]}
    assert modes == {("target-only", 0), ("fixed", 2), ("as-is", 2)}
    for c in report["cells"]:
        assert c["tokens"] == c["requests"] * 4 and c["tokens_per_s"] > 0
        if c["k"]:
            assert c["alpha_source"] == "solved from mean accepted per round"
    assert report["guard"]["exact_first_probs"]
    assert not report["guard"]["fixed_mismatch"] and report["guard"]["control_detected"]
    assert report["transformers"] is None  # a remote app: no in-process baseline


class _DriftingBackend:
    """A backend whose machine slows down with every request it runs (the drift of a shared
    VM), logging which cell ran which requests under which invariance. Backends built with
    the same `machine` (a one-item list: requests served) drift together."""

    def __init__(self, machine=None, cost=1.0):
        from benchmarks.backends import Output, RunStats

        self.Output, self.RunStats = Output, RunStats
        self.log, self.invariant, self.machine, self.cost = [], None, machine or [0], cost

    def run(self, requests, concurrency, progress=None):
        outs = []
        for r in requests:
            sp = r["sampling_params"]
            outs.append(self.Output(num_tokens=sp["max_tokens"], text="", seed=sp["seed"],
                                    speculation={}, token_ids=[1, 2]))
        self.log.append((self.invariant, sp.get("num_speculative_tokens"),
                         sp.get("drafter_invariant"), [r["sampling_params"]["seed"] for r in requests]))
        wall = 0.0
        for _ in requests:
            self.machine[0] += 1
            wall += self.cost * (1.0 + 0.05 * self.machine[0])  # each request 5 % slower
        return outs, self.RunStats(wall_s=wall)


def test_shipped_cells_take_turns_so_drift_falls_on_all_alike():
    """Cells that cost the same measure the same ratio on a drifting machine: they take
    turns prompt by prompt (one at a time) and batch by batch, each turn in the reverse order
    of the one before; run cell by cell, the cell that goes last would look ~1.7x slower."""
    from benchmarks.shipped import interleaved_units, measure_cells, ratios

    assert interleaved_units(3, [[0], [1]]) == [(0, [0]), (1, [0]), (2, [0]),
                                               (2, [1]), (1, [1]), (0, [1])]
    backend = _DriftingBackend()

    def set_invariant(on):
        backend.invariant = on

    rows = measure_cells({"in process": backend}, [[5]] * 4, [parse_setting("t0.6p0.9")],
                         single=4, batch=2,
                         max_tokens=8, seed0=100, invariants=(True, False),
                         set_invariant=set_invariant, adaptive_k=True, drafter_invariant=True,
                         repeats=2)
    ratios(rows, True)
    one = [(inv, k, mode) for inv, k, mode, seeds in backend.log if len(seeds) == 1]
    # one at a time: all five cells run prompt i (seed 100 + i) before any runs prompt i + 1
    seeds = [s[0] for *_, s in backend.log if len(s) == 1]
    assert seeds == [100] * 5 + [101] * 5 + [102] * 5 + [103] * 5
    assert one[:5] == one[5:10][::-1] and len(set(one[:5])) == 5
    # the invariance is switched for the cell that runs, and the standard mode runs once
    assert {(inv, k) for inv, k, _, _ in backend.log} == {(True, 0), (False, 0), (True, None),
                                                          (False, None)}
    batches = [x for x in backend.log if len(x[3]) == 2]
    assert len(batches) == 5 * 2 and batches[:5] == batches[5:][::-1]
    by_cell = {(r["batch_invariant"], r["concurrency"], r["mode"]): r for r in rows}
    assert by_cell[(True, 2, "target-only")]["requests"] == 4  # two runs of the batch
    for r in rows:  # the same cost per request: the same speed, whatever the order
        assert r["speedup"] == pytest.approx(1.0, rel=0.02), r
        if r["batch_invariant"] and r["mode"] != "standard":
            assert r["vs_other_mode"] == pytest.approx(1.0, rel=0.02)
    assert [r["batch_invariant"] for r in rows] == [True] * 6 + [False] * 4  # report order


def test_service_and_in_process_take_turns_on_one_machine():
    """serve_speed's "service / in process": the two places run the same cells in turns on
    one drifting machine, so a service that costs 1.25x the engine measures 0.80x, whatever
    the drift; one place after the other, the drift alone would move the ratio far off."""
    from benchmarks.shipped import measure_cells, ratios

    machine = [0]
    service, local = _DriftingBackend(machine, cost=1.25), _DriftingBackend(machine)
    rows = measure_cells({"service": service, "in process": local}, [[5]] * 4,
                         [parse_setting("greedy")], single=4, batch=2, max_tokens=8, seed0=100,
                         invariants=(True,), adaptive_k=True, drafter_invariant=True)
    ratios(rows, True)
    # prompt by prompt, each place runs both its cells before either runs the next prompt
    assert len(service.log) == len(local.log) == 2 * 4 + 2 * 2
    assert [r["place"] for r in rows] == ["service"] * 4 + ["in process"] * 4
    for r in rows:
        assert r["speedup"] == pytest.approx(1.0, rel=0.02), r
        if r["place"] == "service":
            assert r["vs_in_process"] == pytest.approx(0.8, rel=0.02), r
        else:
            assert "vs_in_process" not in r
