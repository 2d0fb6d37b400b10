"""Small random-weight Qwen2 models with the real tokenizer, for fast tests.

Weights are drawn so that the next-token distributions are neither uniform nor one-hot: an
untied lm_head scaled to give logits of standard deviation `logit_std` makes the tiny model a
random but peaked "language model" over the real 151,936-token vocabulary.

`make_tiny_draft` perturbs a tiny target's weights, giving a draft that agrees with the target
often but not always (a realistic acceptance rate); `make_tiny_model` with another seed or
size gives an unrelated draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _vocab_size(tokenizer_dir: Path, tokenizer) -> int:
    """The model vocab size of the tokenizer's own model (padded), else the tokenizer's."""
    cfg = Path(tokenizer_dir) / "config.json"
    if cfg.is_file():
        return int(json.loads(cfg.read_text())["vocab_size"])
    return len(tokenizer)


def make_tiny_model(out_dir, tokenizer_dir, *, num_layers: int = 2, hidden_size: int = 64,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 2048, seed: int = 0,
                    init_std: float = 0.1, logit_std: float = 6.0,
                    tie_word_embeddings: bool = False, dtype=torch.float32) -> Path:
    """Writes a random Qwen2ForCausalLM (config.json, model.safetensors, tokenizer) to out_dir."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab_size = _vocab_size(Path(tokenizer_dir), tokenizer)
    pad = tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad if pad is not None and pad < vocab_size else None,
        initializer_range=init_std)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)  # not all ones, so a wrong norm weight shows in tests
            elif name.endswith("bias"):
                p.normal_(0.0, init_std)
        if not tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, logit_std / hidden_size**0.5)
    model.to(dtype).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def make_tiny_draft(out_dir, target_dir, *, noise: float = 0.05, seed: int = 1) -> Path:
    """A draft with the target's architecture whose weights are the target's plus gaussian
    noise of `noise` times each tensor's standard deviation."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(target_dir))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = p.std() if p.numel() > 1 else p.abs()
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise * scale)
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(str(out_dir))
    return Path(out_dir)


def make_tiny_pair(root, tokenizer_dir, *, seed: int = 0, noise: float = 0.05) -> tuple[Path, Path]:
    """(draft_dir, target_dir) under root: a tiny target and a perturbed copy as its draft."""
    root = Path(root)
    target = make_tiny_model(root / "tiny-target", tokenizer_dir, seed=seed)
    draft = make_tiny_draft(root / "tiny-draft", target, noise=noise, seed=seed + 1)
    return draft, target
