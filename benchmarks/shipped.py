"""The shipped configuration, side by side in one run: what `ray_config.yaml` deploys, run in
process on the same engine as target-only decoding (K = 0), with and without batch
invariance, at concurrency 1 and in one batch; plus the calibration the runners chose.

Every ratio is measured in this run: speculative / target-only for the same setting,
concurrency and mode; invariant / non-invariant for the same cell.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml


CONFIG = Path(__file__).resolve().parent.parent / "ray_config.yaml"
# The proposal vocabulary the comparison tries when the shipped draft keeps its whole head.
OTHER_PROPOSAL_VOCAB = 32_768


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


def other_mode(default_drafter_invariant: bool) -> tuple[str, dict]:
    """The seeded mode a deployment does not default to: its cell name and request field."""
    if default_drafter_invariant:
        return "standard", {"drafter_invariant": False}
    return "drafter-invariant", {"drafter_invariant": True}


def measure_cells(backend, prompt_ids, settings, *, single: int, batch: int, max_tokens: int,
                  seed0: int, invariant: bool, adaptive_k: bool, drafter_invariant: bool,
                  other: bool = True, progress=None) -> list[dict]:
    """Target-only and speculative cells (requests leave K and the mode to the deployment,
    whose default mode is `drafter_invariant`), one at a time (`single` prompts) and in one
    batch of `batch`; with `other`, sampled settings also run the other mode (standard or
    drafter-invariant) at both concurrencies. `backend`: in process or over HTTP
    (benchmarks.backends)."""
    rows = []
    for s in settings:
        for c, n in ((1, single), (batch, batch)):
            cells = [("target-only", 0, None), ("speculative", None, None)]
            if other and not s.greedy:
                name, field = other_mode(drafter_invariant)
                cells.append((name, None, field))
            for mode, k, extra in cells:
                reqs = _requests(prompt_ids[:n], s.params, k=k, max_tokens=max_tokens,
                                 seed0=seed0, extra=extra)
                cb = progress(f"shipped inv={invariant} {s.label} {mode} c={c}",
                              len(reqs) * max_tokens) if progress else None
                outs, stats = backend.run(reqs, c, progress=cb)
                rows.append(_row(outs, stats, batch_invariant=invariant, setting=s.key,
                                 setting_label=s.label, concurrency=c, mode=mode,
                                 k="adaptive" if k is None and adaptive_k else k,
                                 drafter_invariant=(extra or {}).get("drafter_invariant",
                                                                     drafter_invariant)))
    return rows


def compare_proposal_vocab(backend, prompt_ids, settings, *, single: int, max_tokens: int,
                           seed0: int, shipped_vocab: int | None, progress=None) -> list[dict]:
    """The speculative cells at concurrency 1 again with a draft whose vocabulary head is
    the other choice (whole when the shipped draft is pruned, OTHER_PROPOSAL_VOCAB ids when
    it is whole), on the same engine: acceptance and tokens/s of the two heads."""
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
    engine.draft = backend.draft = other
    if info.k_costs:  # adaptive K from this draft's own measured cost, the target's as is
        target = dict(engine.target.calibration(),
                      pass_ms=dict(zip(info.k_costs.pass_rows, info.k_costs.target_pass_ms)))
        engine.info = replace(info, k_costs=Costs.from_calibrations(
            with_pass_costs(other.runner, draft=True), target))
    rows = []
    try:
        for s in settings:
            reqs = _requests(prompt_ids[:single], s.params, k=None, max_tokens=max_tokens, seed0=seed0)
            cb = progress(f"draft vocabulary {vocab or 'whole'} {s.label}",
                          len(reqs) * max_tokens) if progress else None
            outs, stats = backend.run(reqs, 1, progress=cb)
            rows.append(_row(outs, stats, setting=s.key, setting_label=s.label, concurrency=1,
                             proposal_vocab=other.proposal_vocab or "whole",
                             drafter_invariant=info.default_drafter_invariant))
    finally:
        engine.draft, backend.draft, engine.info = shipped, shipped, info
    return rows


def run_shipped(draft_dir, target_dir, prompt_ids: list[list[int]], settings, *, single: int,
                batch: int, max_tokens: int, seed0: int, progress=None, config_path: Path = CONFIG) -> dict:
    """settings: benchmarks.run.Setting list. single: prompts run one at a time; batch: the
    concurrency (and number of prompts) of the batched cells."""
    from benchmarks.backends import LocalBackend

    cfg = shipped_config(config_path)
    t0 = time.perf_counter()
    backend = LocalBackend(draft_dir, target_dir, dtype=cfg.target.dtype,
                           batch_invariant=cfg.target.batch_invariant, adaptive_k=cfg.adaptive_k,
                           num_speculative_tokens=cfg.num_speculative_tokens,
                           proposal_vocab=cfg.draft.proposal_vocab,
                           drafter_invariant=cfg.drafter_invariant)
    load_s = time.perf_counter() - t0
    engine = backend.engine
    calibration = {"draft": engine.draft.calibration(), "target": engine.target.calibration(),
                   "k_costs": engine.info.k_costs.to_dict() if engine.info.k_costs else None}
    shipped_inv = cfg.target.batch_invariant
    rows = []
    backend.run(_requests(prompt_ids[:1], {"temperature": 1.0}, k=None, max_tokens=4, seed0=0), 1)
    for invariant in (shipped_inv, not shipped_inv):
        for runner in (engine.draft, engine.target):
            runner.set_batch_invariant(invariant)
        rows += measure_cells(backend, prompt_ids, settings, single=single, batch=batch,
                              max_tokens=max_tokens, seed0=seed0, invariant=invariant,
                              adaptive_k=cfg.adaptive_k, drafter_invariant=cfg.drafter_invariant,
                              other=invariant == shipped_inv,
                              progress=progress)
    for runner in (engine.draft, engine.target):
        runner.set_batch_invariant(shipped_inv)
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
                       "max_tokens": max_tokens, "single_prompts": single, "batch": batch},
            "engine": describe, "calibration": calibration, "rows": rows,
            "proposal_vocab_rows": vocab_rows}


def vocab_ratios(vocab_rows: list[dict], rows: list[dict], shipped_inv: bool) -> None:
    """Each other-head cell against the shipped draft's and target-only, same setting, c=1."""
    for r in vocab_rows:
        def cell(mode):
            return next(x for x in rows if x["batch_invariant"] == shipped_inv and x["concurrency"] == 1
                        and x["setting"] == r["setting"] and x["mode"] == mode)
        r["speedup"] = r["tokens_per_s"] / cell("target-only")["tokens_per_s"]
        r["vs_shipped_draft"] = r["tokens_per_s"] / cell("speculative")["tokens_per_s"]
        r["shipped_acceptance_rate"] = cell("speculative")["acceptance_rate"]
        if r["setting"] == "greedy" or r["drafter_invariant"]:
            base = cell("target-only")["texts"]
            r["same_text"] = sum(a == b for a, b in zip(r["texts"], base))


def ratios(rows: list[dict], shipped_inv: bool) -> None:
    """speedup (vs target-only of the same cell), texts equal to target-only's (greedy and
    drafter-invariant cells), vs the other batch-invariance setting."""
    def find(**keys):
        return next((r for r in rows if all(r[k] == v for k, v in keys.items())), None)

    for r in rows:
        base = find(batch_invariant=r["batch_invariant"], setting=r["setting"],
                    concurrency=r["concurrency"], mode="target-only")
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["decode_tokens_per_s"] and base["decode_tokens_per_s"]:
            r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        if r["mode"] != "target-only" and (r["setting"] == "greedy" or r["drafter_invariant"]):
            # greedy and drafter-invariant texts must be the target-only texts of their seeds
            r["same_text"] = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        other = find(batch_invariant=not r["batch_invariant"], setting=r["setting"],
                     concurrency=r["concurrency"], mode=r["mode"])
        if r["batch_invariant"] == shipped_inv and other:
            r["vs_other_mode"] = r["tokens_per_s"] / other["tokens_per_s"]


def markdown(section: dict, hf: dict | None = None) -> list[str]:
    cfg, cal = section["config"], section["calibration"]
    lines = ["## The shipped configuration (ray_config.yaml, in process)", "",
             f"- weights: draft {cal['draft']['format']}, target {cal['target']['format']} "
             f"(configured `{cfg['draft_dtype']}` / `{cfg['dtype']}`); batch_invariant "
             f"{cfg['batch_invariant']}; K {'adaptive up to ' if cfg['adaptive_k'] else ''}"
             f"{cfg['num_speculative_tokens']}; requests that leave the mode unset run "
             f"{'drafter-invariant' if cfg.get('drafter_invariant') else 'standard'} "
             f"(`speculative`); {cfg['max_tokens']} tokens per request, "
             f"{cfg['single_prompts']} prompts one at a time, {cfg['batch']} in one batch",
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
