"""Facts about a model's vocabulary that the request loop and a draft's pruned head need."""

from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_dir: str | Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's EOS plus the model's generation
    config's (Qwen2.5 instruct models end turns with <|im_end|> and text with
    <|endoftext|>)."""
    ids = _config_eos_ids(model_dir)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _config_eos_ids(model_dir: str | Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return ids


def proposal_ids(model_dir: str | Path, size: int, vocab_size: int) -> list[int]:
    """The token ids a draft with a `size`-token proposal vocabulary keeps in its head: the
    `size` lowest ids plus every special token (the tokenizer's added tokens and the EOS
    ids), so that a proposal can still end a sequence.

    Byte-level BPE vocabularies (Qwen2, Llama 3, GPT-2) number tokens in merge order, most
    frequent first, so the lowest ids hold most of any text's tokens (HumanEval solutions
    with Qwen2.5: 3.7 % of tokens lie above id 32,768, 0.8 % above 65,536). The rest get
    probability 0 in the proposals; rejection sampling still returns the target's
    distribution, at a lower acceptance where the target picks them."""
    if size <= 0:
        raise ValueError(f"proposal_vocab={size}: give a positive number of token ids")
    ids = set(range(min(size, vocab_size)))
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    if tokenizer_file.exists():
        ids.update(int(t["id"]) for t in json.loads(tokenizer_file.read_text()).get("added_tokens", []))
    ids |= _config_eos_ids(model_dir)
    return sorted(i for i in ids if 0 <= i < vocab_size)
