"""Facts about a model's vocabulary that the request loop needs."""

from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_dir: str | Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's EOS plus the model's generation
    config's (Qwen2.5 instruct models end turns with <|im_end|> and text with
    <|endoftext|>)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return tuple(sorted(ids))
