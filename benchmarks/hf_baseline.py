"""transformers' own assisted generation on the same pair and prompts, as a baseline.

`model.generate(..., assistant_model=draft)` (with transformers' defaults for the assistant:
how many tokens it drafts per round is transformers' choice, recorded in the report) against
`model.generate(...)` without an assistant, greedy and sampled, batch 1 (transformers'
assisted generation supports batch size 1 only). Sampling parameters are passed explicitly
(top_k=0, repetition_penalty=1) so that they equal the benchmark's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


# transformers 5's defaults when the assistant's generation config leaves them unset.
_ASSISTANT_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                       "assistant_confidence_threshold": 0.4}


def _load(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    return model


def run_hf_baseline(draft_dir, target_dir, prompts_ids: Sequence[Sequence[int]],
                    settings: Sequence[tuple[str, dict]], *, max_tokens: int, ignore_eos: bool,
                    dtype: str = "bfloat16", seed0: int = 0,
                    assistant_tokens: int | None = None,
                    progress: Callable[[str, int], Callable[[int], None]] | None = None) -> dict:
    import transformers

    torch_dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    target = _load(target_dir, torch_dtype)
    draft = _load(draft_dir, torch_dtype)
    load_s = time.perf_counter() - t0
    if assistant_tokens:  # a fixed number of draft tokens per round, like this engine's K
        draft.generation_config.num_assistant_tokens = assistant_tokens
        draft.generation_config.num_assistant_tokens_schedule = "constant"
    rows = []
    for name, params in settings:
        greedy = params.get("temperature", 1.0) == 0.0
        kwargs = dict(max_new_tokens=max_tokens, repetition_penalty=1.0)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=params.get("temperature", 1.0),
                          top_p=params.get("top_p", 1.0), top_k=0)
        for mode in ("target-only", "assisted"):
            extra = {"assistant_model": draft} if mode == "assisted" else {}
            cb = progress(f"transformers {mode} {name}", max_tokens * len(prompts_ids)) \
                if progress else None
            tokens, wall = 0, 0.0
            for i, ids in enumerate(prompts_ids):
                inputs = torch.tensor([list(ids)])
                torch.manual_seed(seed0 + i)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(inputs, attention_mask=torch.ones_like(inputs),
                                          pad_token_id=target.config.eos_token_id, **kwargs,
                                          **extra)
                wall += time.perf_counter() - start
                n = int(out.shape[1] - inputs.shape[1])
                tokens += n
                if cb:
                    cb(n)
            rows.append({"setting": name, "mode": mode, "requests": len(prompts_ids),
                         "tokens": tokens, "wall_s": wall,
                         "tokens_per_s": tokens / wall if wall else None})
    for row in rows:
        base = next(r for r in rows if r["setting"] == row["setting"] and r["mode"] == "target-only")
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    gc = draft.generation_config
    info = {"transformers_version": transformers.__version__, "load_s": load_s}
    for name, default in _ASSISTANT_DEFAULTS.items():  # None in the config: transformers' default
        value = getattr(gc, name, None)
        info[name] = f"{default} (default)" if value is None else value
    del target, draft
    return {"info": info, "rows": rows}
