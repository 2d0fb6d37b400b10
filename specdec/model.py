"""A compact forward for the Qwen2 / Llama family, with tensor parallelism and a batched
variable-length KV cache.

Why our own: sharding heads and MLP across ranks (issue 6) and feeding many requests of
different lengths through one forward pass against per-request caches (issue 3) are easier
to keep right here than inside transformers' modules.

Layout of one forward pass: the new tokens of all requests are concatenated into T rows. Row-
local work (embedding, norms, linears, RoPE, MLP) runs on [T, hidden]; attention runs per
request against that request's own cache. Tensor parallel: q/k/v and gate/up are column-
parallel (each rank holds a slice of the heads / intermediate units), o_proj and down_proj
are row-parallel and followed by an all-reduce; embedding and lm_head are replicated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open


class TensorParallel(NamedTuple):
    """This process's place in a tensor-parallel group. group=None: the default group."""

    rank: int = 0
    size: int = 1
    group: Any = None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hf_config: Any  # transformers' config, for RoPE variants

    @classmethod
    def from_dir(cls, model_dir) -> "ModelConfig":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(str(model_dir))
        if c.model_type not in ("qwen2", "llama", "mistral"):
            raise ValueError(f"{model_dir}: model_type {c.model_type!r} is not supported "
                             "(Qwen2 / Llama family only)")
        if getattr(c, "use_sliding_window", False):
            raise ValueError(f"{model_dir}: sliding-window attention is not supported")
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)), hf_config=c)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling, as transformers computes them."""
    c = config.hf_config
    params = getattr(c, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        dim = config.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](c, torch.device("cpu"))


class KVCache:
    """One request's keys and values on this rank: [layers, kv_heads, capacity, head_dim].

    `length` positions are valid; cropping sets `length`. Growth reallocates to at least
    twice the capacity, so copies are rare (amortised O(1) per token)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, capacity=0):
        self.shape = (num_layers, num_kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.length = 0
        self.k = self.v = None
        self.capacity = 0
        self.reserve(capacity)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity, 16)
        cap = -(-cap // 16) * 16
        L, H, _, D = self.shape
        k = torch.empty(L, H, cap, D, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self.capacity = k, v, cap


class Segment(NamedTuple):
    """A request's new rows in one forward: `length` tokens at positions start..start+length-1.
    Rows of successive segments are consecutive in the batch, in segment order."""

    cache: KVCache
    start: int
    length: int


class Qwen2Model:
    """Weights and forward for one tensor-parallel rank (the whole model when tp_size == 1)."""

    def __init__(self, model_dir, *, dtype=torch.bfloat16, device="cpu", tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, row_block: int | None = None):
        self.model_dir = Path(model_dir)
        self.config = cfg = ModelConfig.from_dir(model_dir)
        self.dtype, self.device = dtype, torch.device(device)
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        # row_block: compute linears in fixed-size row blocks (batch invariance, issue 7).
        self.row_block = row_block
        for name, n in (("attention heads", cfg.num_heads), ("kv heads", cfg.num_kv_heads),
                        ("intermediate size", cfg.intermediate_size)):
            if n % tp_size:
                raise ValueError(f"{name} ({n}) must be divisible by tp_size ({tp_size})")
        self.heads = cfg.num_heads // tp_size
        self.kv_heads = cfg.num_kv_heads // tp_size
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.float().to(self.device)
        self._load()

    # ------------------------------------------------------------------ weights

    def _files(self) -> dict[str, Path]:
        """tensor name -> safetensors file (single file or sharded with an index)."""
        single = self.model_dir / "model.safetensors"
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return {k: single for k in f.keys()}
        index = self.model_dir / "model.safetensors.index.json"
        if not index.is_file():
            raise FileNotFoundError(f"{self.model_dir}: no model.safetensors(.index.json); "
                                    "only safetensors weights are loaded")
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: self.model_dir / v for k, v in weight_map.items()}

    def _load(self) -> None:
        files = self._files()
        handles: dict[Path, Any] = {}

        def get(name, shard_dim=None, optional=False):
            """The tensor `name`, sliced to this rank along shard_dim (0: rows, 1: columns)."""
            path = files.get(name)
            if path is None:
                if optional:
                    return None
                raise KeyError(f"{self.model_dir}: weight {name!r} not found")
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            sl = handles[path].get_slice(name)
            if shard_dim is None or self.tp_size == 1:
                t = sl[:]
            else:
                n = sl.get_shape()[shard_dim] // self.tp_size
                lo, hi = self.tp_rank * n, (self.tp_rank + 1) * n
                t = sl[lo:hi] if shard_dim == 0 else sl[:, lo:hi]
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        def cat(ts):
            return torch.cat(ts, 0) if all(t is not None for t in ts) else None

        self.embed = get("model.embed_tokens.weight")
        self.layers = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            # q, k and v (and gate, up) are fused so that each is one matmul.
            self.layers.append(dict(
                ln1=get(p + "input_layernorm.weight"),
                ln2=get(p + "post_attention_layernorm.weight"),
                qkv=cat([get(a + f"{x}_proj.weight", 0) for x in "qkv"]),
                qkv_bias=cat([get(a + f"{x}_proj.bias", 0, optional=True) for x in "qkv"]),
                o=get(a + "o_proj.weight", 1),
                o_bias=get(a + "o_proj.bias", optional=True),
                gate_up=cat([get(m + "gate_proj.weight", 0), get(m + "up_proj.weight", 0)]),
                down=get(m + "down_proj.weight", 1),
            ))
        self.norm = get("model.norm.weight")
        self.lm_head = get("lm_head.weight", optional=True)
        if self.lm_head is None:
            self.lm_head = self.embed  # tied embeddings
        handles.clear()

    # ------------------------------------------------------------------ pieces

    def new_cache(self, capacity: int = 0) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, self.kv_heads, c.head_dim, self.dtype, self.device, capacity)

    def _linear(self, x, w, b=None):
        # Batch shape is where a row's numerics can depend on the other rows: a GEMM over
        # [T, hidden] may pick a different kernel / reduction order for a different T. With
        # row_block set, every matmul runs on blocks of exactly row_block rows (the last one
        # zero-padded), so a row's result depends only on its own data.
        B = self.row_block
        if B is None:
            return F.linear(x, w, b)
        T = x.shape[0]
        pad = -T % B
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = torch.cat([F.linear(blk, w, b) for blk in x.split(B)])
        return out[:T]

    def _row_parallel(self, x, w, b=None):
        out = self._linear(x, w)
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.tp_group)
        return out if b is None else out + b  # the bias once, after the sum

    def _rms_norm(self, x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * h.to(x.dtype)

    def _rope(self, positions):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)[:, None, :]
        return cos, sin

    @staticmethod
    def _apply_rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _attention(self, i, layer, x, cos, sin, segments):
        c, H, KV = self.config, self.heads, self.kv_heads
        D = c.head_dim
        qkv = self._linear(x, layer["qkv"], layer["qkv_bias"])
        q, k, v = qkv.split([H * D, KV * D, KV * D], -1)
        q = self._apply_rope(q.view(-1, H, D), cos, sin)
        k = self._apply_rope(k.view(-1, KV, D), cos, sin)
        v = v.view(-1, KV, D)
        out = torch.empty_like(q)
        row = 0
        for seg in segments:  # each request attends to its own cache only
            r, s, n = slice(row, row + seg.length), seg.start, seg.length
            seg.cache.k[i, :, s : s + n] = k[r].transpose(0, 1)
            seg.cache.v[i, :, s : s + n] = v[r].transpose(0, 1)
            keys = seg.cache.k[i, :, : s + n].unsqueeze(0)
            vals = seg.cache.v[i, :, : s + n].unsqueeze(0)
            out[r] = self._attend(q[r].transpose(0, 1).unsqueeze(0), keys, vals, s)[0].transpose(0, 1)
            row += n
        return self._row_parallel(out.reshape(-1, H * D), layer["o"], layer["o_bias"])

    def _attend(self, q, keys, vals, start: int):
        """q [1, H, n, D] at positions start.. over keys / vals [1, KV, start + n, D], causal."""
        n, gqa = q.shape[2], self.heads != self.kv_heads
        if self.row_block is not None and n > 1:  # one row: the plain call below is the same
            # Invariant mode: each position attends exactly as a one-row decode step would, so
            # its output does not depend on how many positions are computed together (prefill,
            # a K+1-row verify, a re-prefill after failover); SDPA blocks by query length.
            return torch.cat([
                F.scaled_dot_product_attention(q[:, :, j : j + 1], keys[:, :, : start + j + 1],
                                               vals[:, :, : start + j + 1], enable_gqa=gqa)
                for j in range(n)], dim=2)
        mask = None
        if n > 1 and start > 0:  # causal, offset by the cached prefix
            qpos = torch.arange(start, start + n, device=q.device)[:, None]
            mask = torch.arange(start + n, device=q.device)[None, :] <= qpos
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask,
                                              is_causal=(n > 1 and start == 0), enable_gqa=gqa)

    def _mlp(self, layer, x):
        gate, up = self._linear(x, layer["gate_up"]).chunk(2, -1)
        return self._row_parallel(F.silu(gate) * up, layer["down"])

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[Segment], logit_rows: torch.Tensor) -> torch.Tensor:
        """Feeds `tokens` [T] at `positions` [T] (rows grouped by `segments`, whose caches
        must have capacity for start + length and receive the new keys / values) and returns
        float32 logits [len(logit_rows), vocab] for the selected rows."""
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, self._rms_norm(x, layer["ln1"]), cos, sin, segments)
            x = x + self._mlp(layer, self._rms_norm(x, layer["ln2"]))
        h = self._rms_norm(x[logit_rows], self.norm)
        return self._linear(h, self.lm_head).float()

    def weight_bytes(self) -> int:
        """Bytes of weights this rank reads per forward (for bandwidth figures)."""
        ts = [self.lm_head, self.norm]  # the embedding is only indexed, a few rows
        ts += [t for layer in self.layers for t in layer.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


def load_model(model_dir, *, dtype=torch.bfloat16, device="cpu", tp: TensorParallel | None = None,
               row_block: int | None = None) -> Qwen2Model:
    tp = tp or TensorParallel()
    return Qwen2Model(model_dir, dtype=dtype, device=device, tp_rank=tp.rank, tp_size=tp.size,
                      tp_group=tp.group, row_block=row_block)


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(names)}")
    return names[dtype]

