"""The shipped configuration, side by side in one run: what `ray_config.yaml` deploys, run in
process on the same engine as target-only decoding (K = 0), with and without batch
invariance, at concurrency 1 and in one batch; plus the calibration the runners chose.

Every ratio is measured in this run: speculative / target-only for the same setting,
concurrency and mode; invariant / non-invariant for the same cell.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import yaml

from benchmarks.backends import LocalBackend, RunStats


CONFIG = Path(__file__).resolve().parent.parent / "ray_config.yaml"
# The proposal vocabulary the comparison tries when the shipped draft keeps its whole head.
OTHER_PROPOSAL_VOCAB = 32_768
IN_PROCESS = "in process"  # the place of the in-process cells (measure_cells)
# How many times each batched cell runs, in turns with the others (interleaved_units).
BATCH_RUNS = 2


def shipped_config(path: Path = CONFIG):
    """The AppConfig of the first application in a Serve config file."""
    from deployments.config import AppConfig

    apps = yaml.safe_load(Path(path).read_text())["applications"]
    return AppConfig.model_validate(apps[0].get("args") or {})


def _requests(prompt_ids, params: dict, *, k, max_tokens: int, seed0: int, extra=None) -> list[dict]:
    reqs = []
    for i, ids in enumerate(prompt_ids):
        sp = dict(params, max_tokens=max_tokens, min_tokens=max_tokens, seed=seed0 + i, **(extra or {}))
        if k is not None:
            sp["num_speculative_tokens"] = k
        reqs.append({"prompt_token_ids": list(ids), "sampling_params": sp})
    return reqs


def _row(outs, stats, **keys) -> dict:
    tokens = sum(o.num_tokens for o in outs)
    spec = [o.speculation for o in outs]
    proposed = sum(s.get("proposed") or 0 for s in spec)
    accepted = sum(s.get("accepted") or 0 for s in spec)
    rounds = sum(s.get("rounds") or 0 for s in spec)
    decode_s = stats.wall_s - stats.first_step_s
    measured_first = stats.first_step_s > 0  # in process only
    return dict(keys, requests=len(outs), tokens=tokens, wall_s=stats.wall_s,
                tokens_per_s=tokens / stats.wall_s,
                decode_tokens_per_s=(tokens - stats.first_step_tokens) / decode_s
                if measured_first and decode_s > 0 else None,
                acceptance_rate=accepted / proposed if proposed else None,
                mean_k=proposed / rounds if rounds else 0.0,
                tokens_per_round=tokens / rounds if rounds else None,
                texts=[o.token_ids if o.token_ids is not None else o.text for o in outs])


def _add(total: RunStats, part: RunStats) -> None:
    for f in ("wall_s", "first_step_s", "first_step_tokens"):
        setattr(total, f, getattr(total, f) + getattr(part, f))


def other_mode(default_drafter_invariant: bool) -> tuple[str, dict]:
    """The seeded mode a deployment does not default to: its cell name and request field."""
    if default_drafter_invariant:
        return "standard", {"drafter_invariant": False}
    return "drafter-invariant", {"drafter_invariant": True}


def interleaved_units(cells: int, units: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The order the cells of one setting and concurrency run in: (cell, request indices).

    Cells are compared by ratios, and a shared machine drifts by 10-15 % from one minute to
    the next (measured on a 2-core VM: the same kernels ran 1.00-1.18x apart as consecutive
    cells). So the cells take turns unit by unit (a prompt, or a whole batch), and drift
    falls on all of them alike. Each turn reverses the order of the one before (A B C,
    C B A, ...), so a steady drift does not favour the cell that goes first."""
    order = []
    for turn, unit in enumerate(units):
        cell_order = range(cells) if turn % 2 == 0 else reversed(range(cells))
        order += [(cell, unit) for cell in cell_order]
    return order


def measure_cells(backends: dict, prompt_ids, settings, *, single: int, batch: int,
                  max_tokens: int, seed0: int, invariants: Sequence[bool], adaptive_k: bool,
                  drafter_invariant: bool, set_invariant=None, repeats: int = BATCH_RUNS,
                  progress=None) -> list[dict]:
    """Target-only and speculative cells (requests leave K and the mode to the deployment,
    whose default mode is `drafter_invariant`), one at a time (`single` prompts) and in one
    batch of `batch` (run `repeats` times); sampled settings also run the other mode
    (standard or drafter-invariant) under the first of `invariants`. Every cell runs in each
    of `backends` ({place: backend}, in process or over HTTP: benchmarks.backends) and under
    each of `invariants`, switched by `set_invariant(bool)` (None: the backends' only mode).
    The cells of a setting and concurrency take turns (interleaved_units)."""
    rows = []
    other_name, other_field = other_mode(drafter_invariant)
    for s in settings:
        cells = []
        for place in backends:
            cells += [(place, inv, "target-only", 0, None) for inv in invariants]
            cells += [(place, inv, "speculative", None, None) for inv in invariants]
            if not s.greedy:
                cells.append((place, invariants[0], other_name, None, other_field))
        one_by_one = [[i] for i in range(single)]
        for c, turns, runs in ((1, one_by_one, 1), (batch, [list(range(batch))] * repeats, repeats)):
            reqs = [_requests(prompt_ids[:max(single, batch)], s.params, k=k,
                              max_tokens=max_tokens, seed0=seed0, extra=extra)
                    for *_, k, extra in cells]
            outs, stats = [[] for _ in cells], [RunStats() for _ in cells]
            units = interleaved_units(len(cells), turns)
            cb = progress(f"shipped {s.label} c={c} ({len(cells)} cells)",
                          sum(len(u) for _, u in units) * max_tokens) if progress else None
            for cell, unit in units:
                place, inv = cells[cell][:2]
                if set_invariant is not None:
                    set_invariant(inv)
                o, st = backends[place].run([reqs[cell][i] for i in unit], c, progress=cb)
                outs[cell] += o
                _add(stats[cell], st)
            for (place, inv, mode, k, extra), o, st in zip(cells, outs, stats):
                rows.append(_row(o, st, place=place, batch_invariant=inv, setting=s.key,
                                 setting_label=s.label, concurrency=c, mode=mode,
                                 k="adaptive" if k is None and adaptive_k else k,
                                 runs=runs,
                                 drafter_invariant=(extra or {}).get("drafter_invariant",
                                                                     drafter_invariant)))
    places = list(backends)
    rows.sort(key=lambda r: (places.index(r["place"]), invariants.index(r["batch_invariant"])))
    return rows


def compare_proposal_vocab(backend, prompt_ids, settings, *, single: int, max_tokens: int,
                           seed0: int, shipped_vocab: int | None, progress=None) -> list[dict]:
    """The speculative cells at concurrency 1 again with a draft whose vocabulary head is
    the other choice (whole when the shipped draft is pruned, OTHER_PROPOSAL_VOCAB ids when
    it is whole), on the same engine, taking turns prompt by prompt with the shipped draft
    (interleaved_units): acceptance and tokens/s of the two heads."""
    from dataclasses import replace

    from benchmarks.backends import _TimedRunner
    from specdec.k_policy import Costs
    from specdec.pass_costs import with_pass_costs
    from specdec.runner import ModelRunner

    engine, info = backend.engine, backend.engine.info
    shipped = engine.draft
    vocab = None if shipped_vocab else OTHER_PROPOSAL_VOCAB
    other = _TimedRunner(ModelRunner(shipped.runner.model_dir, dtype=shipped.runner.model.format,
                                     batch_invariant=shipped.runner.batch_invariant,
                                     proposal_vocab=vocab))
    other_info = info
    if info.k_costs:  # adaptive K from this draft's own measured cost, the target's as is
        target = dict(engine.target.calibration(),
                      pass_ms=dict(zip(info.k_costs.pass_rows, info.k_costs.target_pass_ms)))
        other_info = replace(info, k_costs=Costs.from_calibrations(
            with_pass_costs(other.runner, draft=True), target))
    drafts = [(shipped, info), (other, other_info)]  # the shipped draft runs again beside it
    rows = []
    try:
        for s in settings:
            reqs = _requests(prompt_ids[:single], s.params, k=None, max_tokens=max_tokens, seed0=seed0)
            cb = progress(f"draft vocabulary {vocab or 'whole'} {s.label}",
                          2 * len(reqs) * max_tokens) if progress else None
            outs, stats = [[], []], [RunStats(), RunStats()]
            for d, unit in interleaved_units(2, [[i] for i in range(single)]):
                engine.draft, engine.info = drafts[d]
                backend.draft = engine.draft
                o, st = backend.run([reqs[i] for i in unit], 1, progress=cb)
                outs[d] += o
                _add(stats[d], st)
            twin = _row(outs[0], stats[0])
            row = _row(outs[1], stats[1], setting=s.key, setting_label=s.label, concurrency=1,
                       proposal_vocab=other.proposal_vocab or "whole",
                       drafter_invariant=info.default_drafter_invariant,
                       shipped_acceptance_rate=twin["acceptance_rate"])
            rows.append(dict(row, vs_shipped_draft=row["tokens_per_s"] / twin["tokens_per_s"]))
    finally:
        engine.draft, backend.draft, engine.info = shipped, shipped, info
    return rows


def shipped_backend(draft_dir, target_dir, cfg):
    """The in-process engine as `cfg` (an AppConfig, shipped_config()) deploys it."""
    return LocalBackend(draft_dir, target_dir, dtype=cfg.target.dtype,
                        batch_invariant=cfg.target.batch_invariant, adaptive_k=cfg.adaptive_k,
                        num_speculative_tokens=cfg.num_speculative_tokens,
                        proposal_vocab=cfg.draft.proposal_vocab,
                        drafter_invariant=cfg.drafter_invariant)


def run_shipped(draft_dir, target_dir, prompt_ids: list[list[int]], settings, *, single: int,
                batch: int, max_tokens: int, seed0: int, progress=None, config_path: Path = CONFIG) -> dict:
    """settings: benchmarks.run.Setting list. single: prompts run one at a time; batch: the
    concurrency (and number of prompts) of the batched cells."""
    cfg = shipped_config(config_path)
    t0 = time.perf_counter()
    backend = shipped_backend(draft_dir, target_dir, cfg)
    load_s = time.perf_counter() - t0
    engine = backend.engine
    calibration = {"draft": engine.draft.calibration(), "target": engine.target.calibration(),
                   "k_costs": engine.info.k_costs.to_dict() if engine.info.k_costs else None}
    shipped_inv = cfg.target.batch_invariant
    backend.run(_requests(prompt_ids[:1], {"temperature": 1.0}, k=None, max_tokens=4, seed0=0), 1)

    def set_invariant(on: bool) -> None:
        for runner in (engine.draft, engine.target):
            if runner.batch_invariant != on:
                runner.set_batch_invariant(on)

    rows = measure_cells({IN_PROCESS: backend}, prompt_ids, settings, single=single, batch=batch,
                         max_tokens=max_tokens, seed0=seed0,
                         invariants=(shipped_inv, not shipped_inv), set_invariant=set_invariant,
                         adaptive_k=cfg.adaptive_k, drafter_invariant=cfg.drafter_invariant,
                         progress=progress)
    set_invariant(shipped_inv)
    ratios(rows, shipped_inv)
    vocab_rows = compare_proposal_vocab(backend, prompt_ids, settings, single=single,
                                        max_tokens=max_tokens, seed0=seed0,
                                        shipped_vocab=cfg.draft.proposal_vocab, progress=progress)
    vocab_ratios(vocab_rows, rows, shipped_inv)
    describe = dict(backend.describe, load_s=load_s)
    backend.close()
    for r in rows + vocab_rows:
        del r["texts"]
    return {"config": {"dtype": cfg.target.dtype, "draft_dtype": cfg.draft.dtype,
                       "proposal_vocab": engine.draft.proposal_vocab,
                       "batch_invariant": shipped_inv, "adaptive_k": cfg.adaptive_k,
                       "num_speculative_tokens": cfg.num_speculative_tokens,
                       "drafter_invariant": cfg.drafter_invariant,
                       "max_tokens": max_tokens, "single_prompts": single, "batch": batch,
                       "batch_runs": BATCH_RUNS},
            "engine": describe, "calibration": calibration, "rows": rows,
            "proposal_vocab_rows": vocab_rows}


def vocab_ratios(vocab_rows: list[dict], rows: list[dict], shipped_inv: bool) -> None:
    """Each other-head cell against target-only (same setting, c=1) and its texts against
    target-only's; against the shipped draft it was measured beside (compare_proposal_vocab)."""
    for r in vocab_rows:
        def cell(mode):
            return next(x for x in rows if x["batch_invariant"] == shipped_inv and x["concurrency"] == 1
                        and x["setting"] == r["setting"] and x["mode"] == mode)
        r["speedup"] = r["tokens_per_s"] / cell("target-only")["tokens_per_s"]
        if r["setting"] == "greedy" or r["drafter_invariant"]:
            base = cell("target-only")["texts"]
            r["same_text"] = sum(a == b for a, b in zip(r["texts"], base))


def ratios(rows: list[dict], shipped_inv: bool) -> None:
    """speedup (vs target-only of the same cell and place), texts equal to target-only's
    (greedy and drafter-invariant cells), vs the other batch-invariance setting, and (cells
    of another place, e.g. the service) vs the same cell in process."""
    def find(**keys):
        return next((r for r in rows if all(r[k] == v for k, v in keys.items())), None)

    for r in rows:
        base = find(place=r["place"], batch_invariant=r["batch_invariant"], setting=r["setting"],
                    concurrency=r["concurrency"], mode="target-only")
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["decode_tokens_per_s"] and base["decode_tokens_per_s"]:
            r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        if r["mode"] != "target-only" and (r["setting"] == "greedy" or r["drafter_invariant"]):
            # greedy and drafter-invariant texts must be the target-only texts of their seeds
            r["same_text"] = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        other = find(place=r["place"], batch_invariant=not r["batch_invariant"],
                     setting=r["setting"], concurrency=r["concurrency"], mode=r["mode"])
        if r["batch_invariant"] == shipped_inv and other:
            r["vs_other_mode"] = r["tokens_per_s"] / other["tokens_per_s"]
        in_process = find(place=IN_PROCESS, batch_invariant=r["batch_invariant"],
                          setting=r["setting"], concurrency=r["concurrency"], mode=r["mode"])
        if r["place"] != IN_PROCESS and in_process:
            r["in_process_tokens_per_s"] = in_process["tokens_per_s"]
            r["vs_in_process"] = r["tokens_per_s"] / in_process["tokens_per_s"]


def markdown(section: dict, hf: dict | None = None) -> list[str]:
    cfg, cal = section["config"], section["calibration"]
    lines = ["## The shipped configuration (ray_config.yaml, in process)", "",
             f"- weights: draft {cal['draft']['format']}, target {cal['target']['format']} "
             f"(configured `{cfg['draft_dtype']}` / `{cfg['dtype']}`); batch_invariant "
             f"{cfg['batch_invariant']}; K {'adaptive up to ' if cfg['adaptive_k'] else ''}"
             f"{cfg['num_speculative_tokens']}; requests that leave the mode unset run "
             f"{'drafter-invariant' if cfg.get('drafter_invariant') else 'standard'} "
             f"(`speculative`); {cfg['max_tokens']} tokens per request, "
             f"{cfg['single_prompts']} prompts one at a time, {cfg['batch']} in one batch "
             f"(run {cfg.get('batch_runs', 1)} times); the cells of a setting take turns prompt by "
             "prompt and batch by batch, so a machine's drift falls on all alike",
             f"- target kernels: {cal['target']['kernels']}; attention "
             f"{cal['target'].get('attention', 'torch')}",
             f"- target matmul estimate (ms at rows): {cal['target']['forward_ms']}; invariance "
             f"costs {cal['target']['invariance_cost']}x the fastest kernels; dtype=auto candidates "
             f"(ms at rows {'/'.join(map(str, cal['target']['forward_ms']))}): {cal['target'].get('formats_ms')}",
             f"- draft matmul estimate (ms at rows): {cal['draft']['forward_ms']}; dtype=auto "
             f"candidates (a draft may also take w8a8): {cal['draft'].get('formats_ms')}",
             f"- adaptive-K cost table: {cal['k_costs']}", "",
             "| invariant | setting | c | mode | tok/s | vs target-only | decode vs target-only "
             "| acceptance | mean K | vs batch_invariant flipped | text = target-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in section["rows"]:
        def f(x, fmt="{:.2f}"):
            return "" if x is None else fmt.format(x)
        lines.append(
            f"| {r['batch_invariant']} | {r['setting_label']} | {r['concurrency']} | {r['mode']} | "
            f"{r['tokens_per_s']:.2f} | {f(r.get('speedup'), '{:.2f}x')} | "
            f"{f(r.get('decode_speedup'), '{:.2f}x')} | {f(r['acceptance_rate'])} | "
            f"{f(r['mean_k'])} | {f(r.get('vs_other_mode'), '{:.2f}x')} | "
            f"{'' if 'same_text' not in r else str(r['same_text']) + '/' + str(r['requests'])} |")
    if section.get("proposal_vocab_rows"):
        lines += ["", f"Draft vocabulary head (shipped: {cfg.get('proposal_vocab') or 'whole'}), "
                  "speculative at c=1, against the shipped draft on the same engine:", "",
                  "| draft vocabulary | setting | tok/s | vs target-only | vs shipped draft | "
                  "acceptance | shipped acceptance | mean K |", "|---|---|---|---|---|---|---|---|"]
        for r in section["proposal_vocab_rows"]:
            lines.append(f"| {r['proposal_vocab']} | {r['setting_label']} | {r['tokens_per_s']:.2f} | "
                         f"{r['speedup']:.2f}x | {r['vs_shipped_draft']:.2f}x | "
                         f"{r['acceptance_rate'] or 0:.3f} | {r['shipped_acceptance_rate'] or 0:.3f} | "
                         f"{r['mean_k']:.2f} |")
    if hf:
        for row in hf.get("rows", []):
            spec = next((r for r in section["rows"] if r["setting"] == row["setting"] and
                         r["concurrency"] == 1 and r["mode"] == "speculative" and
                         r["batch_invariant"] == cfg["batch_invariant"]), None)
            if spec and row.get("mode") == "assisted" and row.get("tokens_per_s"):
                lines.append(f"\nShipped speculative vs transformers' assisted generation, "
                             f"{row['setting']}: {spec['tokens_per_s'] / row['tokens_per_s']:.2f}x")
    return lines + [""]
