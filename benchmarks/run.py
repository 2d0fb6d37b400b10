"""The benchmark sweep: settings x modes x K x concurrency, target-only and transformers
baselines, the guard, then the report (JSON, Markdown, PNG plots).

Longer than 300 lines because it is the sweep's one driver: cells, summaries, the
verdict and the report writer read the same row dictionaries.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import prompts as prompt_sets
from benchmarks.guard import greedy_exactness, run_guard
from benchmarks.stats import alpha_from_mean_accepted, tokens_per_round

MACHINE_BANDWIDTH_GBPS = 21.0  # memory read bandwidth measured on the 2-core development machine


# ---- settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    key: str  # as given on the command line: greedy, t0.6p0.9, t1.0, t0.8p0.95k20
    label: str
    params: dict

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 1.0) == 0.0


def parse_setting(key: str) -> Setting:
    key = key.strip()
    if key in ("greedy", "t0"):
        return Setting("greedy", "greedy", {"temperature": 0.0})
    m = re.fullmatch(r"t(\d+(?:\.\d+)?)(?:p(\d*\.?\d+))?(?:k(\d+))?", key)
    if not m:
        raise ValueError(f"unknown sampling setting {key!r}: use greedy, or t<T>[p<top_p>][k<top_k>]"
                         " such as t0.6p0.9 or t1.0")
    params = {"temperature": float(m.group(1))}
    label = f"T={float(m.group(1)):g}"
    if m.group(2):
        params["top_p"] = float(m.group(2))
        label += f" top_p={float(m.group(2)):g}"
    if m.group(3):
        params["top_k"] = int(m.group(3))
        label += f" top_k={int(m.group(3))}"
    if params["temperature"] == 0.0:
        return Setting("greedy", "greedy", {"temperature": 0.0})
    return Setting(key, label, params)


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


# ---- progress -------------------------------------------------------------------------------


class Progress:
    """One bar over the cells, one bar over the tokens of the current cell."""

    def __init__(self, total_cells: int, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.enabled = enabled
        self.outer = tqdm(total=total_cells, desc="cells", unit="cell", position=0,
                          disable=not enabled, dynamic_ncols=True)
        self.inner = None

    def cell(self, desc: str, total_tokens: int):
        self.close_inner()
        self.inner = self._tqdm(total=total_tokens, desc=desc, unit="tok", position=1,
                                leave=False, disable=not self.enabled, dynamic_ncols=True)
        return self.inner.update

    def close_inner(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None
            self.outer.update(1)

    def close(self) -> None:
        self.close_inner()
        self.outer.close()


# ---- one cell -----------------------------------------------------------------------------


def _requests(prompt_ids, setting: Setting, *, k: int, target_probs: str, max_tokens: int,
              fixed_length: bool, seed0: int) -> list[dict]:
    reqs = []
    for i, ids in enumerate(prompt_ids):
        sp = dict(setting.params, num_speculative_tokens=k, target_probs=target_probs,
                  max_tokens=max_tokens, seed=seed0 + i)
        if fixed_length:
            sp["min_tokens"] = max_tokens  # EOS is banned on both sides: every request is full
        reqs.append({"prompt_token_ids": list(ids), "sampling_params": sp})
    return reqs


def summarize(outputs, stats, *, k: int, backend, datasets: list[str]) -> dict:
    spec = [o.speculation for o in outputs]
    tokens = sum(o.num_tokens for o in outputs)
    rounds = sum(s.get("rounds") or 0 for s in spec)
    proposed = sum(s.get("proposed") or 0 for s in spec)
    accepted = sum(s.get("accepted") or 0 for s in spec)
    emitted = sum(s.get("emitted") or 0 for s in spec)
    slots = sum((s["emitted"] / s["system_efficiency"]) if s.get("system_efficiency") else 0
                for s in spec)
    log = stats.log
    row = {
        "requests": len(outputs), "tokens": tokens, "wall_s": stats.wall_s,
        "tokens_per_s": tokens / stats.wall_s if stats.wall_s else None,
        "rounds": rounds, "proposed": proposed, "accepted": accepted, "emitted": emitted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "system_efficiency": emitted / slots if slots else None,
        "tokens_per_round": emitted / rounds if rounds else None,
    }
    decode_s = stats.wall_s - stats.first_step_s
    if stats.first_step_s and decode_s > 0:
        row["decode_tokens_per_s"] = (tokens - stats.first_step_tokens) / decode_s
        row["first_round_s"] = stats.first_step_s
    if k and log is not None and log.tested:
        row["alpha"] = log.accepted / log.tested
        row["alpha_source"] = "accepted / tested"
        row["alpha_by_position"] = [a / t if t else None
                                    for a, t in zip(log.accepted_at, log.tested_at)]
        if log.overlap_tested_n:
            row["overlap_tested"] = log.overlap_tested / log.overlap_tested_n
            row["overlap_all"] = log.overlap_all / log.overlap_n
            gap = log.accepted - log.overlap_tested
            if log.overlap_var > 1e-9:
                row["overlap_z"] = gap / math.sqrt(log.overlap_var)
            else:  # deterministic (greedy): acceptance must equal argmax agreement exactly
                row["overlap_z"] = 0.0 if abs(gap) < 0.5 else math.inf
        row["full_accept_rounds"] = log.full
    elif k and proposed:
        row["alpha"] = alpha_from_mean_accepted(accepted / rounds, k) if rounds else None
        row["alpha_source"] = "solved from mean accepted per round"
    row["tokens_per_round_analytic"] = tokens_per_round(row.get("alpha"), k) if k else 1.0
    if stats.draft_passes or stats.target_passes:
        row.update(
            draft_passes=stats.draft_passes, target_passes=stats.target_passes,
            draft_forward_s=stats.draft_forward_s, target_forward_s=stats.target_forward_s,
            other_s=stats.step_s - stats.draft_forward_s - stats.target_forward_s,
            engine_rounds=stats.rounds,
            draft_ms_per_pass=1e3 * stats.draft_forward_s / stats.draft_passes
            if stats.draft_passes else None,
            target_ms_per_pass=1e3 * stats.target_forward_s / stats.target_passes
            if stats.target_passes else None,
        )
        row["other_ms_per_round"] = 1e3 * row["other_s"] / stats.rounds if stats.rounds else None
        if backend.draft_bytes and stats.wall_s:
            read = backend.draft_bytes * stats.draft_passes + backend.target_bytes * stats.target_passes
            row["bandwidth_gbps"] = read / stats.wall_s / 1e9
            row["bandwidth_fraction"] = row["bandwidth_gbps"] / MACHINE_BANDWIDTH_GBPS
    by_ds = {}
    for ds in sorted(set(datasets)):
        sel = [s for s, d in zip(spec, datasets) if d == ds]
        p = sum(s.get("proposed") or 0 for s in sel)
        a = sum(s.get("accepted") or 0 for s in sel)
        e = sum(s.get("emitted") or 0 for s in sel)
        r = sum(s.get("rounds") or 0 for s in sel)
        by_ds[ds] = {"requests": len(sel), "acceptance_rate": a / p if p else None,
                     "tokens_per_round": e / r if r else None}
    row["by_dataset"] = by_ds
    return row


# ---- the sweep ---------------------------------------------------------------------------


def plan_cells(args, settings: list[Setting]) -> list[dict]:
    """Every (setting, concurrency, mode, K) cell to run, target-only first in each group.

    Concurrency 1 runs every setting; a higher concurrency runs the --batched-settings only,
    in fixed mode (as-is too with --batched-as-is). Greedy is never run as-is (a raw target
    against a one-hot draft measures nothing the sampled settings do not)."""
    cells = []
    raw_keys = _keys(args.raw_settings)
    batched_keys = _keys(args.batched_settings)
    for s in settings:
        modes = ["fixed"]
        if not s.greedy and ("all" in raw_keys or s.key in raw_keys):
            modes.append("as-is")
        for c in args.concurrency:
            if c > 1 and not ("all" in batched_keys or s.key in batched_keys):
                continue
            cell_modes = modes if c == 1 or args.batched_as_is else ["fixed"]
            cells.append({"setting": s, "mode": "target-only", "k": 0, "concurrency": c})
            for k in args.ks:
                for mode in cell_modes:
                    cells.append({"setting": s, "mode": mode, "k": k, "concurrency": c})
    return cells


def _keys(text) -> set[str]:
    return {x.strip() for x in (text or "").split(",") if x.strip()}


def resolve_dtype(dtype: str) -> str:
    """transformers' dtype for 'auto': bfloat16 where the CPU computes it natively (AVX-512
    BF16 or AMX), else float32 (on AVX2-only CPUs torch emulates bf16 matmuls, several times
    slower). Our engine measures its own choice (specdec.runner.choose_format)."""
    if dtype != "auto":
        return dtype
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    from specdec.kernels import cpu_flags

    if not Path("/proc/cpuinfo").exists():  # not Linux: nothing to tell by
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(cpu_flags()) else "float32"


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    from specdec.kernels import cpu_flags, cpuinfo, isa_caps

    cpu = cpuinfo("model name")
    if cpu:
        info["cpu"] = cpu
    info["simd"] = sorted({f for f in cpu_flags() if f.startswith(("avx", "amx"))})
    if isa_caps():  # the kernels run capped: say so beside the flags they may use
        info["isa_caps"] = isa_caps()
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0]
        info["memory"] = mem.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    import torch

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    return info


def run(args) -> dict:
    import torch

    started = time.time()
    hf_dtype = resolve_dtype(args.dtype)
    for key, value in dict(shipped=False, shipped_prompts=12, shipped_batch=8, shipped_tokens=64,
                           shipped_settings="greedy,t0.6p0.9").items():
        if getattr(args, key, None) is None:  # callers that build args without the parser
            setattr(args, key, value)
    settings = [parse_setting(s) for s in args.settings.split(",") if s.strip()]
    machine_before = machine_info()

    # Models and backend.
    if args.draft and args.target:
        draft_dir, target_dir = Path(args.draft), Path(args.target)
    else:
        from specdec.model_pair import ensure_default_pair

        draft_dir, target_dir = ensure_default_pair()
    if args.url:
        from transformers import AutoTokenizer

        from benchmarks.backends import HttpBackend

        backend = HttpBackend(args.url, AutoTokenizer.from_pretrained(str(target_dir)),
                              api_key=args.api_key)
    else:
        from benchmarks.backends import LocalBackend

        t0 = time.perf_counter()
        backend = LocalBackend(draft_dir, target_dir, dtype=args.dtype)
        backend.describe["load_s"] = time.perf_counter() - t0
    tok = backend.tokenizer

    # Prompts: round-robin over the datasets, the same list (and seeds) for every cell.
    per_ds = [prompt_sets.load(ds) for ds in args.datasets.split(",") if ds.strip()]
    pool = [p for group in zip(*per_ds) for p in group]
    longest = max(len(g) for g in per_ds)
    for group in per_ds:  # datasets of unequal size: the longer one's rest at the end
        if len(group) == longest:
            pool += group[min(len(g) for g in per_ds):]
    if not pool:
        raise SystemExit("no prompts")

    def prompts_for(c: int):
        n = max(c, math.ceil(args.num_prompts / c) * c)
        chosen = [pool[i % len(pool)] for i in range(n)]
        ids = [tok(p.text, add_special_tokens=True)["input_ids"] for p in chosen]
        return chosen, ids

    cells = plan_cells(args, settings)
    n_guard = (1 + len(args.guard_arms)) if args.guard_n else 0
    n_hf = 2 * len(args.hf_settings.split(",")) if args.hf_prompts and not args.url else 0
    n_shipped = 11 * len(args.shipped_settings.split(",")) if args.shipped and not args.url else 0
    progress = Progress(len(cells) + n_guard + n_hf + n_shipped + (1 if args.warmup else 0),
                        enabled=not args.no_progress)
    results, outputs_by_cell = [], {}

    if args.warmup and not args.url:  # first forwards allocate; keep them out of the first cell
        cb = progress.cell("warm-up", 8)
        _, ids = prompts_for(1)
        warm = _requests(ids[:1], parse_setting("t1.0"), k=max(args.ks), target_probs="processed",
                         max_tokens=8, fixed_length=True, seed0=0)
        backend.run(warm, 1, progress=cb)

    for cell in cells:
        s, mode, k, c = cell["setting"], cell["mode"], cell["k"], cell["concurrency"]
        chosen, ids = prompts_for(c)
        reqs = _requests(ids, s, k=k, target_probs="raw" if mode == "as-is" else "processed",
                         max_tokens=args.max_tokens, fixed_length=not args.natural_length,
                         seed0=args.seed)
        desc = f"{s.label} {mode} K={k} c={c}"
        cb = progress.cell(desc, len(reqs) * args.max_tokens)
        outs, stats = backend.run(reqs, c, progress=cb)
        row = {"setting": s.key, "setting_label": s.label, "params": s.params, "mode": mode,
               "k": k, "concurrency": c,
               "prompt_tokens_mean": sum(map(len, ids)) / len(ids)}
        row.update(summarize(outs, stats, k=k, backend=backend,
                             datasets=[p.dataset for p in chosen]))
        results.append(row)
        outputs_by_cell[(s.key, mode, k, c)] = outs
        _write_partial(args.out, results)
    # Speedup against target-only measured in this run (same setting, same concurrency).
    for row in results:
        base = next(r for r in results if r["setting"] == row["setting"]
                    and r["concurrency"] == row["concurrency"] and r["mode"] == "target-only")
        row["speedup"] = (row["tokens_per_s"] / base["tokens_per_s"]
                          if base["tokens_per_s"] else None)
        if row.get("decode_tokens_per_s") and base.get("decode_tokens_per_s"):
            row["decode_speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]

    # Greedy exactness: speculative greedy text must equal target-only greedy text.
    greedy = []
    for (key, mode, k, c), outs in outputs_by_cell.items():
        if key == "greedy" and k and mode == "fixed":
            ref = outputs_by_cell.get(("greedy", "target-only", 0, c))
            if ref:
                greedy.append({"k": k, "concurrency": c, **greedy_exactness(outs, ref)})

    # The guard against fast-but-wrong.
    guard = None
    if args.guard_n:
        gs = parse_setting(args.guard_setting)
        gids = tok(prompt_sets.GUARD_PROMPT, add_special_tokens=True)["input_ids"]
        allowed = sorted({tok(d, add_special_tokens=False)["input_ids"][0]
                          for d in prompt_sets.GUARD_TOKENS})
        guard = run_guard(backend, prompt_ids=gids, allowed_ids=allowed, setting_name=gs.label,
                          params=gs.params, k=args.guard_k, n=args.guard_n,
                          max_tokens=args.guard_tokens, concurrency=args.guard_concurrency,
                          alpha=args.guard_alpha, arms=tuple(args.guard_arms),
                          progress=progress.cell)

    # The shipped configuration (ray_config.yaml) side by side, on its own engine.
    shipped = None
    if args.shipped and not args.url:
        from benchmarks.shipped import run_shipped

        backend.close()  # one engine in memory at a time
        he = [p for p in pool if p.dataset == "humaneval"] or pool
        he_ids = [tok(p.text, add_special_tokens=True)["input_ids"] for p in
                  (he[i % len(he)] for i in range(max(args.shipped_prompts, args.shipped_batch)))]
        shipped = run_shipped(draft_dir, target_dir, he_ids,
                              [parse_setting(x) for x in args.shipped_settings.split(",")],
                              single=args.shipped_prompts, batch=args.shipped_batch,
                              max_tokens=args.shipped_tokens, seed0=args.seed,
                              progress=progress.cell)

    # transformers' assisted generation on the same pair and prompts.
    hf = None
    if n_hf:
        backend.close()  # free the engine's weights first
        del backend
        backend = None
        from benchmarks.hf_baseline import run_hf_baseline

        _, ids = prompts_for(1)
        if shipped:  # the shipped section's prompts, so that the two compare
            ids = he_ids
        hf_settings = [(st.key, st.params) for st in
                       (parse_setting(x) for x in args.hf_settings.split(","))]
        hf = run_hf_baseline(draft_dir, target_dir, ids[: args.hf_prompts], hf_settings,
                             max_tokens=args.shipped_tokens if shipped else args.max_tokens, ignore_eos=not args.natural_length,
                             dtype=hf_dtype, seed0=args.seed, progress=progress.cell,
                             assistant_tokens=args.hf_assistant_tokens)
        for row in hf["rows"]:
            ours = next((r for r in results if r["setting"] == row["setting"]
                         and r["concurrency"] == 1 and r["mode"] == "target-only"), None)
            row["vs_our_target_only"] = (row["tokens_per_s"] / ours["tokens_per_s"]
                                         if ours and ours["tokens_per_s"] else None)
    progress.close()

    describe = dict(backend.describe) if backend is not None else {}
    if not describe and not args.url:
        describe = {"backend": "in-process", "draft": str(draft_dir), "target": str(target_dir),
                    "dtype": args.dtype}
    report = {
        "version": 1,
        "command": "python -m benchmarks " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "elapsed_s": time.time() - started,
        "machine": machine_before,
        "load_avg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "engine": describe,
        "config": {
            "ks": args.ks, "settings": [asdict(s) for s in settings], "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
            "datasets": args.datasets, "raw_settings": args.raw_settings,
            "fixed_length": not args.natural_length, "seed": args.seed,
            "batched_settings": args.batched_settings, "batched_as_is": args.batched_as_is,
            "dtype": args.dtype,
            "machine_bandwidth_gbps": MACHINE_BANDWIDTH_GBPS,
        },
        "cells": results,
        "greedy_exactness": greedy,
        "guard": guard,
        "transformers": hf,
        "shipped": shipped,
        "torch_threads": torch.get_num_threads(),
    }
    report["verdict"] = verdict(report)
    return report


def verdict(report: dict) -> dict:
    """The report's headline flags."""
    flags = []
    g = report.get("guard")
    if g is not None:
        if g.get("fixed_mismatch"):
            flags.append("FAST-BUT-WRONG: fixed-mode output tokens are not distributed as "
                         "target-only sampling (guard mismatch)")
        if g.get("control_detected") is False:
            flags.append("guard has no power here: the as-is (raw target) control was not "
                         "detected; raise --guard-n")
    for row in report["cells"]:
        z = row.get("overlap_z")
        if z is not None and abs(z) > 4 and row["mode"] != "target-only":
            flags.append(f"{row['setting_label']} {row['mode']} K={row['k']} "
                         f"c={row['concurrency']}: measured acceptance deviates from "
                         f"Σ min(p, q) (z = {z:.1f}): a sampler bug")
    for gx in report.get("greedy_exactness") or []:
        if gx["identical"] < gx["total"]:
            flags.append(f"greedy K={gx['k']} c={gx['concurrency']}: {gx['total'] - gx['identical']}"
                         f"/{gx['total']} outputs differ from target-only greedy (first "
                         f"divergence at tokens {gx['first_divergence']}; near-tie numerics?)")
    return {"ok": not any(f.startswith(("FAST", "guard has")) or "sampler bug" in f
                          for f in flags), "flags": flags}


def write_outputs(report: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    from benchmarks.report import markdown, make_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    p = out_dir / "results.json"
    p.write_text(json.dumps(_clean(report), indent=1, default=_json_default, allow_nan=False))
    paths.append(p)
    images = make_plots(report, out_dir) if plots else []
    paths += images
    p = out_dir / "report.md"
    p.write_text(markdown(report, images=[i.name for i in images]))
    paths.append(p)
    return paths


def _write_partial(out: str, results: list[dict]) -> None:
    """The cells so far (out/partial.json), to follow a long run or keep a crashed one."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "partial.json").write_text(json.dumps(_clean(results), indent=1,
                                                        default=_json_default))
    except OSError:
        pass


def _clean(o):
    """Strict JSON: non-finite floats become strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def main_args(args) -> int:
    report = run(args)
    paths = write_outputs(report, Path(args.out), plots=not args.no_plots)
    from benchmarks.report import console_summary

    print(console_summary(report), file=sys.stdout)
    for p in paths:
        print(f"wrote {p}")
    return 0 if report["verdict"]["ok"] else 2
