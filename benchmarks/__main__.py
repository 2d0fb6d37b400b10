"""`python -m benchmarks` (console script `specdec-bench`): the speculative decoding benchmark.

Reproduces the as-is vs fixed table of vLLM PR 10198 on the local pair and measures speedup
against target-only decoding and transformers' assisted generation. See docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import sys

# Defaults: the shipped configuration side by side (12 HumanEval prompts x 64 tokens one at a
# time and 8 in one batch, greedy and T=0.6 / top_p=0.9, invariant and not), transformers'
# assisted generation on the same prompts, the seed's as-is vs fixed table at K=3, the guard.
# About 40 minutes on the 2-core CPU with the default pair; --quick: minutes.
DEFAULTS = dict(ks="3", settings="t0.6p0.9", raw_settings="t0.6p0.9", concurrency="1",
                batched_settings="t0.6p0.9", batched_as_is=False, max_tokens=40, num_prompts=1,
                datasets="humaneval,prose", guard_n=96, guard_k=3, guard_tokens=3,
                guard_concurrency=48, hf_prompts=12, hf_settings="greedy,t0.6p0.9",
                shipped=True, shipped_prompts=12, shipped_batch=8, shipped_tokens=64,
                shipped_settings="greedy,t0.6p0.9")
QUICK = dict(ks="1,3", settings="greedy,t0.6p0.9", raw_settings="t0.6p0.9", concurrency="1,4",
             batched_settings="t0.6p0.9", batched_as_is=False, max_tokens=32, num_prompts=1,
             datasets="humaneval,prose", guard_n=48, guard_k=3, guard_tokens=2,
             guard_concurrency=48, hf_prompts=1, hf_settings="greedy", shipped=True,
             shipped_prompts=2, shipped_batch=4, shipped_tokens=16, shipped_settings="t0.6p0.9")
FULL = dict(ks="1,2,3,4", settings="greedy,t0.6p0.9,t1.0", raw_settings="all",
            concurrency="1,8", batched_settings="all", batched_as_is=True, max_tokens=128,
            num_prompts=8, datasets="humaneval,prose", guard_n=600, guard_k=4, guard_tokens=4,
            guard_concurrency=64, hf_prompts=12, hf_settings="greedy,t0.6p0.9", shipped=True,
            shipped_prompts=12, shipped_batch=8, shipped_tokens=128,
            shipped_settings="greedy,t0.6p0.9")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec-bench",
        description="Speculative decoding benchmark: acceptance, system efficiency, tokens/s "
                    "and speedup for as-is (raw target) vs fixed (processed target), against "
                    "target-only decoding and transformers' assisted generation, with a "
                    "guard against fast-but-wrong.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help=f"a few minutes: {QUICK}")
    preset.add_argument("--full", action="store_true", help=f"the complete grid: {FULL}")
    p.add_argument("--url", help="benchmark a running app through its OpenAI API "
                   "(e.g. http://127.0.0.1:8000) instead of the in-process engine")
    p.add_argument("--api-key", help="bearer token for --url (SPECDEC_API_KEY on the server)")
    p.add_argument("--draft", help="draft model folder (default: the default pair)")
    p.add_argument("--target", help="target model folder (default: the default pair)")
    p.add_argument("--dtype", default="auto", help="in-process engine dtype; auto = bfloat16 "
                   "where the CPU has native bf16 (AVX-512 BF16 / AMX), else float32")
    p.add_argument("--ks", help=f"draft tokens per round, comma-separated [{DEFAULTS['ks']}]")
    p.add_argument("--settings", help="sampling settings: greedy, t<T>[p<top_p>][k<top_k>] "
                   f"[{DEFAULTS['settings']}]")
    p.add_argument("--raw-settings", help="settings also run as-is (raw target "
                   f"probabilities); 'all' for every sampled one [{DEFAULTS['raw_settings']}]")
    p.add_argument("--concurrency", help="requests in flight (in-process: the engine's batch "
                   f"size) [{DEFAULTS['concurrency']}]")
    p.add_argument("--batched-settings", help="settings also run at concurrency > 1; 'all' "
                   f"for every one [{DEFAULTS['batched_settings']}]")
    p.add_argument("--batched-as-is", action="store_true", default=None,
                   help="run the as-is mode at concurrency > 1 too")
    p.add_argument("--max-tokens", type=int, help=f"output tokens [{DEFAULTS['max_tokens']}]")
    p.add_argument("--num-prompts", type=int, help="prompts per cell at concurrency 1 (at "
                   f"concurrency c: rounded up to a multiple of c) [{DEFAULTS['num_prompts']}]")
    p.add_argument("--datasets", help=f"prompt sets, round-robin [{DEFAULTS['datasets']}]")
    p.add_argument("--natural-length", action="store_true",
                   help="let requests stop at EOS (default: min_tokens = max_tokens)")
    p.add_argument("--seed", type=int, default=1234, help="first request seed")
    p.add_argument("--guard-n", type=int, help="guard: samples per arm (0 = no guard) "
                   f"[{DEFAULTS['guard_n']}]")
    p.add_argument("--guard-k", type=int, help=f"guard: K [{DEFAULTS['guard_k']}]")
    p.add_argument("--guard-tokens", type=int,
                   help=f"guard: tokens per sample [{DEFAULTS['guard_tokens']}]")
    p.add_argument("--guard-setting", default="t0.6p0.9", help="guard: sampling setting")
    p.add_argument("--guard-concurrency", type=int,
                   help=f"guard: batch size [{DEFAULTS['guard_concurrency']}]")
    p.add_argument("--guard-alpha", type=float, default=1e-3,
                   help="guard: family-wise false-alarm probability")
    p.add_argument("--guard-arms", default="fixed,as-is",
                   help="guard: speculative arms (as-is is the positive control)")
    p.add_argument("--hf-prompts", type=int, help="transformers baseline: prompts (0 = skip) "
                   f"[{DEFAULTS['hf_prompts']}]")
    p.add_argument("--hf-settings", help=f"transformers baseline settings [{DEFAULTS['hf_settings']}]")
    p.add_argument("--hf-assistant-tokens", type=int, help="transformers baseline: draft "
                   "tokens per round, constant (default: transformers' own defaults)")
    p.add_argument("--shipped", dest="shipped", action="store_true", default=None,
                   help="measure the shipped configuration (ray_config.yaml) side by side")
    p.add_argument("--no-shipped", dest="shipped", action="store_false")
    p.add_argument("--shipped-prompts", type=int, help="shipped: HumanEval prompts one at a "
                   f"time [{DEFAULTS['shipped_prompts']}]")
    p.add_argument("--shipped-batch", type=int, help="shipped: prompts in one batch "
                   f"[{DEFAULTS['shipped_batch']}]")
    p.add_argument("--shipped-tokens", type=int, help="shipped: output tokens per request "
                   f"[{DEFAULTS['shipped_tokens']}]")
    p.add_argument("--shipped-settings", help=f"shipped: settings [{DEFAULTS['shipped_settings']}]")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short warm-up generation")
    p.add_argument("--out", default="results/benchmark", help="output folder")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    preset = QUICK if args.quick else FULL if args.full else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ks = [int(x) for x in str(args.ks).split(",") if x.strip()]
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    args.guard_arms = [a for a in args.guard_arms.split(",") if a.strip()]
    if any(k < 1 for k in args.ks):
        raise SystemExit("--ks: K >= 1 (target-only, K = 0, is always measured)")
    if bool(args.draft) != bool(args.target):
        raise SystemExit("give both --draft and --target, or neither")
    args.argv = argv
    return args


def main(argv=None) -> int:
    from benchmarks.run import main_args

    return main_args(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
