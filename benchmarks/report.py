"""Rendering a benchmark report: Markdown tables, a console summary, PNG plots.

Longer than 300 lines because the Markdown tables, the console summary and the plots
render the same report.
"""

from __future__ import annotations

from pathlib import Path

# vLLM PR 10198, Llama-3-70B / 8B, T=0.6 top_p=0.9, batch 1 (as published in that pull request).
SEED_TABLE = {1: (65.1, 81.9, 82.5, 91.0), 2: (63.3, 80.5, 68.3, 82.3), 3: (62.4, 80.2, 57.4, 75.4)}


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _f(x, nd=2) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:.{nd}f}"


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _find(cells, **kw):
    return next((c for c in cells if all(c.get(k) == v for k, v in kw.items())), None)


def seed_tables(report: dict) -> list[str]:
    """For every setting with both modes: the seed's table (K, acceptance, system efficiency,
    as-is vs fixed), plus tokens/s and speedup, per concurrency."""
    out = []
    cells = report["cells"]
    keys = []
    for c in cells:
        if c["mode"] == "as-is" and (c["setting"], c["concurrency"]) not in keys:
            keys.append((c["setting"], c["concurrency"]))
    for key, conc in keys:
        label = _find(cells, setting=key)["setting_label"]
        base = _find(cells, setting=key, concurrency=conc, mode="target-only")
        out.append(f"**{label}, concurrency {conc}** (target-only: "
                   f"{_f(base and base['tokens_per_s'])} tokens/s)\n")
        out.append("| K | acceptance as-is | acceptance fixed | system efficiency as-is | "
                   "system efficiency fixed | tokens/s as-is | tokens/s fixed | speedup as-is | "
                   "speedup fixed |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for k in report["config"]["ks"]:
            a = _find(cells, setting=key, concurrency=conc, mode="as-is", k=k)
            f = _find(cells, setting=key, concurrency=conc, mode="fixed", k=k)
            if not a or not f:
                continue
            out.append(f"| {k} | {_pct(a.get('alpha'))} | {_pct(f.get('alpha'))} | "
                       f"{_pct(a['system_efficiency'])} | {_pct(f['system_efficiency'])} | "
                       f"{_f(a['tokens_per_s'])} | {_f(f['tokens_per_s'])} | "
                       f"{_x(a['speedup'])} | {_x(f['speedup'])} |")
        out.append("")
    return out


def cell_table(report: dict) -> list[str]:
    out = ["| setting | mode | c | K | α | accepted / proposed | Σ min(p,q) tested (all) | z | "
           "system eff. | tokens/round (analytic) | tokens/s | speedup | draft ms/pass | "
           "target ms/pass | other ms/round | GB/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        ov = "–"
        if c.get("overlap_tested") is not None:
            ov = f"{c['overlap_tested']:.3f} ({c['overlap_all']:.3f})"
        z = c.get("overlap_z")
        out.append(
            f"| {c['setting_label']} | {c['mode']} | {c['concurrency']} | {c['k']} | "
            f"{_f(c.get('alpha'), 3)} | {_f(c['acceptance_rate'], 3)} | {ov} | "
            f"{'–' if z is None else f'{z:+.1f}'} | {_pct(c['system_efficiency'])} | "
            f"{_f(c['tokens_per_round'])} ({_f(c.get('tokens_per_round_analytic'))}) | "
            f"{_f(c['tokens_per_s'])} | {_x(c.get('speedup'))} | "
            f"{_f(c.get('draft_ms_per_pass'), 0)} | {_f(c.get('target_ms_per_pass'), 0)} | "
            f"{_f(c.get('other_ms_per_round'), 0)} | {_f(c.get('bandwidth_gbps'))} |")
    return out


def time_breakdown(report: dict) -> list[str]:
    """Where a round's time goes, per speculative cell: draft forwards, target forward,
    everything else (logits processing, sampling, packing, rejection, detokenizing)."""
    out = ["| setting | mode | c | K | round ms | draft fwd | target fwd | other | "
           "draft / target per pass | tokens/round |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        if not c.get("engine_rounds"):
            continue
        total = c["draft_forward_s"] + c["target_forward_s"] + c["other_s"]
        if total <= 0:
            continue
        ratio = (c["draft_ms_per_pass"] / c["target_ms_per_pass"]
                 if c.get("draft_ms_per_pass") and c.get("target_ms_per_pass") else None)
        out.append(
            f"| {c['setting_label']} | {c['mode']} | {c['concurrency']} | {c['k']} | "
            f"{1e3 * total / c['engine_rounds']:.0f} | {_pct(c['draft_forward_s'] / total)} | "
            f"{_pct(c['target_forward_s'] / total)} | {_pct(c['other_s'] / total)} | "
            f"{_f(ratio)} | {_f(c['tokens_per_round'])} |")
    return out


def hf_table(report: dict) -> list[str]:
    hf = report.get("transformers")
    if not hf:
        return []
    info = hf["info"]
    out = [f"transformers {info['transformers_version']} `generate`, batch 1, "
           f"{hf['rows'][0]['requests']} prompts; assistant defaults: num_assistant_tokens="
           f"{info['num_assistant_tokens']}, schedule={info['num_assistant_tokens_schedule']}, "
           f"confidence threshold={info['assistant_confidence_threshold']}.\n",
           "| setting | mode | tokens | tokens/s | speedup vs transformers target-only | "
           "vs this engine's target-only |", "|---|---|---|---|---|---|"]
    for r in hf["rows"]:
        out.append(f"| {r['setting']} | {r['mode']} | {r['tokens']} | {_f(r['tokens_per_s'])} | "
                   f"{_x(r['speedup'])} | {_x(r.get('vs_our_target_only'))} |")
    return out


def guard_section(report: dict) -> list[str]:
    g = report.get("guard")
    if not g:
        return ["Guard not run (--guard-n 0)."]
    out = [f"Setting {g['setting']}, K={g['k']}, {g['n_per_arm']} seeds per arm, "
           f"{g['max_tokens']} tokens restricted to {g['allowed_tokens']} digit tokens, "
           f"family-wise α={g['alpha']} (Bonferroni).\n",
           "| arm | verdict | min p-value | threshold | acceptance | top tokens at position 0 |",
           "|---|---|---|---|---|---|"]
    ref = None
    for name, arm in g["arms"].items():
        ref = arm["reference_top_tokens_position0"]
        verdict = "MISMATCH" if arm["mismatch"] else "ok"
        if name == "as-is":
            verdict += " (control: must be flagged)" if arm["mismatch"] else \
                " (control NOT detected)"
        out.append(f"| {name} | {verdict} | {arm['min_p_value']:.3g} | "
                   f"{arm['bonferroni_threshold']:.3g} | {_pct(arm.get('acceptance_rate'))} | "
                   f"{_tops(arm['top_tokens_position0'])} |")
    if ref is not None:
        out.append(f"| target-only | reference | | | | {_tops(ref)} |")
    return out


def _tops(pairs) -> str:
    return ", ".join(f"{t!r}:{n}" for t, n in pairs)


def _caps(machine: dict) -> str:
    caps = machine.get("isa_caps")
    if not caps:
        return ""
    return " (capped by " + ", ".join(f"{k}={v}" for k, v in caps.items()) + ")"


def markdown(report: dict, images: list[str] = ()) -> str:
    m, e, cfg = report["machine"], report["engine"], report["config"]
    lines = ["# Speculative decoding benchmark", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date']}; elapsed {report['elapsed_s'] / 60:.1f} min",
             f"- machine: {m.get('cpu', '?')}, {m.get('cpus')} CPUs, {m.get('memory', '?')}, "
             f"SIMD {', '.join(m.get('simd', [])) or '?'}{_caps(m)}; torch {m.get('torch')} with "
             f"{report['torch_threads']} threads; load average before "
             f"{_load(m.get('load_avg'))}, after {_load(report.get('load_avg_after'))}",
             f"- engine: {e.get('backend')}, dtype {e.get('dtype', '?')}, draft `{e.get('draft', '?')}`, "
             f"target `{e.get('target', '?')}`",
             f"- prompts: {cfg['datasets']} (round-robin), {cfg['num_prompts']} per cell at "
             f"concurrency 1 (one batch at higher concurrency), {cfg['max_tokens']} output tokens "
             f"{'each (EOS banned: min_tokens = max_tokens)' if cfg['fixed_length'] else 'at most'}",
             ""]
    v = report["verdict"]
    lines += ["## Verdict", "", "OK" if v["ok"] else "**PROBLEM**", ""]
    lines += [f"- {f}" for f in v["flags"]] + [""]
    if report.get("shipped"):
        from benchmarks.shipped import markdown as shipped_markdown

        lines += shipped_markdown(report["shipped"], report.get("transformers"))
    lines += ["## The seed's table (as-is = raw target probabilities, fixed = processed)", "",
              "acceptance = α, the per-token acceptance probability (accepted / tested "
              "proposals; vLLM's metric estimates the same); system efficiency = emitted / "
              "(rounds × (K + 1)); speedup against target-only decoding on the same engine in "
              "the same run.", ""]
    lines += seed_tables(report)
    lines += ["## Every cell", "",
              "α = accepted / tested (a proposal is tested when every proposal before it in its "
              "round was accepted); accepted / proposed is SpecStats.acceptance_rate; Σ min(p,q) "
              "is the best acceptance an exact sampler can reach, averaged over tested "
              "proposals (and over all scored ones); z = (accepted − Σ min) / sd: |z| > 4 means "
              "a sampler bug; GB/s = bytes of weights read per second (draft and target "
              f"forward passes) against ~{cfg['machine_bandwidth_gbps']:.0f} GB/s.", ""]
    lines += cell_table(report) + [""]
    lines += ["## Where the time goes", ""] + time_breakdown(report) + [""]
    lines += ["## transformers assisted generation (same pair, same prompts)", ""]
    lines += (hf_table(report) or ["Not run."]) + [""]
    lines += ["## Guard against fast-but-wrong", ""] + guard_section(report) + [""]
    gx = report.get("greedy_exactness") or []
    if gx:
        lines += ["Greedy exactness (speculative text == target-only text, same prompts): "
                  + "; ".join(f"K={g['k']} c={g['concurrency']}: {g['identical']}/{g['total']}"
                              for g in gx), ""]
    for img in images:
        lines += [f"![{img}]({img})", ""]
    return "\n".join(lines)


def _load(la) -> str:
    return "?" if not la else " / ".join(f"{x:.1f}" for x in la)


def console_summary(report: dict) -> str:
    return "\n".join(["", *seed_tables(report), *cell_table(report), "",
                      *guard_section(report), "",
                      "verdict: " + ("OK" if report["verdict"]["ok"] else "PROBLEM"),
                      *[f"  - {f}" for f in report["verdict"]["flags"]]])


def make_plots(report: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    cells = report["cells"]
    ks = report["config"]["ks"]
    concs = report["config"]["concurrency"]
    series = []
    for c in cells:
        key = (c["setting"], c["setting_label"], c["mode"])
        if c["mode"] != "target-only" and key not in series:
            series.append(key)
    paths = []

    # Acceptance vs K (concurrency 1), with Σ min(p, q) dashed.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, mode in series:
        rows = [_find(cells, setting=key, mode=mode, k=k, concurrency=concs[0]) for k in ks]
        xs = [k for k, r in zip(ks, rows) if r and r.get("alpha") is not None]
        line, = ax.plot(xs, [r["alpha"] for r in rows if r and r.get("alpha") is not None],
                        marker="o", label=f"{label} {mode}")
        ov = [(k, r["overlap_tested"]) for k, r in zip(ks, rows) if r and r.get("overlap_tested")]
        if ov:
            ax.plot([k for k, _ in ov], [o for _, o in ov], ls="--", color=line.get_color(),
                    alpha=0.6)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("acceptance α (dashed: Σ min(p, q))")
    ax.set_title(f"Acceptance vs K (concurrency {concs[0]})")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "acceptance_vs_k.png"))

    # Tokens/s vs K, one panel per concurrency, target-only as horizontal lines.
    fig, axes = plt.subplots(1, len(concs), figsize=(6 * len(concs), 4.5), squeeze=False)
    for ax, conc in zip(axes[0], concs):
        for key, label, mode in series:
            rows = [_find(cells, setting=key, mode=mode, k=k, concurrency=conc) for k in ks]
            xs = [k for k, r in zip(ks, rows) if r]
            line, = ax.plot(xs, [r["tokens_per_s"] for r in rows if r], marker="o",
                            label=f"{label} {mode}")
            if mode == "fixed":
                base = _find(cells, setting=key, mode="target-only", concurrency=conc)
                if base:
                    ax.axhline(base["tokens_per_s"], ls=":", color=line.get_color(),
                               label=f"{label} target-only")
        ax.set_xlabel("K")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Throughput vs K, concurrency {conc}")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "tokens_per_s_vs_k.png"))

    # As-is vs fixed: acceptance and system efficiency, with the seed's numbers.
    pairs = [(key, label) for key, label, mode in series if mode == "as-is"]
    if pairs:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, metric, title, idx in ((axes[0], "alpha", "acceptance α", (0, 1)),
                                       (axes[1], "system_efficiency", "system efficiency", (2, 3))):
            for key, label in pairs:
                for mode, style in (("as-is", "s-"), ("fixed", "o-")):
                    rows = [_find(cells, setting=key, mode=mode, k=k, concurrency=concs[0])
                            for k in ks]
                    xs = [k for k, r in zip(ks, rows) if r and r.get(metric) is not None]
                    ax.plot(xs, [r[metric] for r in rows if r and r.get(metric) is not None],
                            style, label=f"{label} {mode} (this run)")
            sk = sorted(SEED_TABLE)
            ax.plot(sk, [SEED_TABLE[k][idx[0]] / 100 for k in sk], "s--", color="gray",
                    alpha=0.7, label="vLLM PR 10198 as-is (70B/8B)")
            ax.plot(sk, [SEED_TABLE[k][idx[1]] / 100 for k in sk], "o--", color="black",
                    alpha=0.7, label="vLLM PR 10198 fixed (70B/8B)")
            ax.set_xlabel("K")
            ax.set_ylabel(title)
            ax.set_title(f"{title}: as-is vs fixed (concurrency {concs[0]})")
            ax.set_xticks(ks)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / "asis_vs_fixed.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
