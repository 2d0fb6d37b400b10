"""vLLM's engine as a scoring backend, measured beside the project's own runner.

For batch sizes 1 and 8 (HumanEval prompts, the default target), each backend first prefills
the prompts, then runs verify-shaped calls: every request sends its prompt plus what earlier
rounds accepted plus K proposals and asks for the K+1 rows of logits (the target's half of a
speculative round). Proposals are the target's own greedy tokens, so every round accepts all K
and the next round's prefix grows by K+1, as in a fully accepted run. Reports per backend:
milliseconds per scoring call, what is handed back (K+1 rows x vocabulary), prefix-cache
hits (vLLM: `num_cached_tokens`), and how far vLLM's rows lie from the own runner's at the
same dtype. Runs in the vLLM virtualenv (scripts/setup_vllm_venv.sh):

    OMP_NUM_THREADS=2 .venv-vllm/bin/python scripts/vllm_spike.py --out docs/vllm_backend.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time

import torch

from benchmarks.prompts import load_humaneval
from benchmarks.run import machine_info
from specdec.model_pair import ensure_default_pair
from specdec.runner import ModelRunner


def scoring_calls(runner, prompts: list[list[int]], continuations: list[list[int]], k: int,
                  rounds: int, tag: str) -> dict:
    """Prefill, then `rounds` verify calls of K+1 rows per request; ms per call."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    t = time.perf_counter()
    runner.extend([(rid, p, 1) for rid, p in zip(ids, prompts)])
    prefill_ms = (time.perf_counter() - t) * 1e3
    ms, rows, cached = [], None, []
    for r in range(rounds):
        upto = r * (k + 1) + k  # accepted so far plus K proposals
        items = [(rid, p + c[:upto], k + 1) for rid, p, c in zip(ids, prompts, continuations)]
        t = time.perf_counter()
        rows = runner.extend(items)
        ms.append((time.perf_counter() - t) * 1e3)
        cached.append(list(getattr(runner, "last_cached_tokens", [])))
    for rid in ids:
        runner.release(rid)
    context = [len(p) + rounds * (k + 1) for p in prompts]
    return dict(prefill_ms=round(prefill_ms, 1), ms_per_call=[round(x, 1) for x in ms],
                median_ms=round(statistics.median(ms[1:] or ms), 1), final_context=context,
                cached_tokens_last_call=cached[-1], rows=rows)


def engine_floor(vllm_runner, prompts, continuations, k: int, rounds: int) -> dict:
    """The same calls through vLLM without logprobs (max_tokens=1): the engine's own cost
    for the K+1 new rows, what a scoring call would cost if the rows came back as a tensor."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm, ms = vllm_runner.llm, []
    for r in range(rounds):
        upto = r * (k + 1) + k
        batch = [{"prompt_token_ids": p + c[:upto]} for p, c in zip(prompts, continuations)]
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        ms.append((time.perf_counter() - t) * 1e3)
    return dict(ms_per_call=[round(x, 1) for x in ms], median_ms=round(statistics.median(ms[1:]), 1))


def greedy_continuations(runner: ModelRunner, prompts, n: int) -> list[list[int]]:
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = runner.extend([(f"g{i}", s, 1) for i, s in enumerate(seqs)])
        for s, row in zip(seqs, logits):
            s.append(int(row[-1].argmax()))
    for i in range(len(prompts)):
        runner.release(f"g{i}")
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def _cell(cell: dict, **keys) -> dict:
    cell.update(keys, peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1))
    print(json.dumps({k: v for k, v in cell.items() if k != "rows"}), flush=True)
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, default=32,
                   help="prompts cut to this many tokens (vLLM's cost grows with the context)")
    p.add_argument("--context-scaling", type=int, nargs="*", default=[32, 64, 128],
                   help="batch-1 prompt lengths for vLLM's cost-vs-context cells")
    p.add_argument("--dtype", default="float32", help="both backends (vLLM has no fp16 GEMM on CPU)")
    args = p.parse_args()
    _, target = ensure_default_pair()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    full = [tok.encode(x.text) for x in load_humaneval(max(args.batches))]
    prompts = [x[: args.prompt_tokens] for x in full]
    results, ref_rows = [], {}
    # The own runners first, then freed: vLLM's scoring path needs the memory.
    for name, kw in ((f"own runner, {args.dtype}", dict(dtype=args.dtype)),
                     ("own runner, auto (shipped)", dict(dtype="auto", batch_invariant=True))):
        runner = ModelRunner(target, **kw)
        if not ref_rows:
            cont = greedy_continuations(runner, prompts, args.rounds * (args.k + 1))
        for b in args.batches:
            cell = scoring_calls(runner, prompts[:b], cont[:b], args.k, args.rounds, f"{b}-{name}-")
            ref_rows.setdefault(b, cell["rows"])
            results.append(_cell(cell, backend=name, batch=b, k=args.k))
        vocab = runner.vocab_size
        del runner
        gc.collect()

    from specdec.vllm_runner import VllmRunner

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache: plenty here
    t = time.perf_counter()
    vllm_runner = VllmRunner(target, dtype=args.dtype, max_model_len=4096,
                             max_num_seqs=max(args.batches), max_num_batched_tokens=2048,
                             gpu_memory_utilization=0.3)  # on CPU: the share of RAM it may take
    start_s = time.perf_counter() - t
    name = f"vLLM {args.dtype}"
    for b in args.batches:
        cell = scoring_calls(vllm_runner, prompts[:b], cont[:b], args.k, args.rounds, f"{b}-v-")
        rows, ref = cell["rows"], ref_rows[b]
        diff = max(float((a - r).abs().max()) for a, r in zip(rows, ref))
        same = sum(int(torch.equal(a.argmax(-1), r.argmax(-1))) for a, r in zip(rows, ref))
        results.append(_cell(cell, backend=name, batch=b, k=args.k, max_abs_logit_diff=round(diff, 4),
                             argmax_rows_agree=f"{same}/{len(rows)}"))
        floor = engine_floor(vllm_runner, prompts[:b], cont[:b], args.k, args.rounds)
        results.append(_cell(floor, backend=f"{name}, no logprobs (engine floor)", batch=b, k=args.k))
    for n in args.context_scaling:
        cell = scoring_calls(vllm_runner, [full[0][:n]], [cont[0]], args.k, 2, f"ctx{n}-")
        results.append(_cell(cell, backend=name, batch=1, k=args.k, prompt_tokens=n))
    for cell in results:
        cell.pop("rows", None)
    out = dict(machine=machine_info(), vllm_version=__import__("vllm").__version__,
               torch=torch.__version__, omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
               vllm_start_s=round(start_s, 1), k=args.k, rounds=args.rounds,
               prompt_tokens=args.prompt_tokens, vocab_size=vocab,
               dense_bytes_per_request_call=(args.k + 1) * vocab * 4, cells=results)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
