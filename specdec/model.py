"""A compact forward for the Qwen2 / Llama family, with tensor parallelism, a paged KV pool
and batched attention.

Why our own: sharding heads and MLP across ranks and feeding many requests of different
lengths through one forward pass against one KV pool are easier to keep right (and batch
invariant, see specdec/attention.py and specdec/kernels.py) here than inside transformers'
modules.

Layout of one forward pass: the new tokens of all requests are concatenated into T rows. Row-
local work (embedding, norms, linears, RoPE, MLP) runs on [T, hidden]; attention runs once
per layer for all rows against the pool (`paged_attention`). Every weight matrix is a
`kernels.Weight` multiplied by the kernel the calibration chose for its shape. Tensor
parallel: q/k/v and gate/up are column-parallel (each rank holds a slice of the heads /
intermediate units), o_proj and down_proj are row-parallel and followed by an all-reduce;
embedding and lm_head are replicated.

Longer than 300 lines because weight loading with tensor-parallel slicing and the
forward are one model definition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open

from specdec import kernels
from specdec.attention import BLOCK_SIZE, paged_attention, plan_attention
from specdec.kernels import Kernel, Weight

# The logit of a token outside a pruned head: finite, so that a request whose every kept
# token is masked (allowed_token_ids elsewhere) still gets a proposal distribution, and far
# enough below real logits that its probability is 0 otherwise.
OUTSIDE_HEAD_LOGIT = -1e4


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


class KVPool:
    """Keys and values of every cached position on this rank, in blocks of BLOCK_SIZE:
    [layers, num_blocks * BLOCK_SIZE, kv_heads, head_dim]. Block 0 stays zero (the padding
    block of the attention); the runner hands out the others."""

    def __init__(self, num_layers, num_blocks, num_kv_heads, head_dim, dtype, device):
        shape = (num_layers, num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
        # empty: memory is committed as blocks are handed out (and zeroed) by the runner
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, :BLOCK_SIZE] = 0
        self.v[:, :BLOCK_SIZE] = 0
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Segment(NamedTuple):
    """A request's new rows in one forward: `length` tokens at positions start..start+length-1,
    cached in the pool blocks `block_table`. Rows of successive segments are consecutive in
    the batch, in segment order."""

    block_table: Sequence[int]
    start: int
    length: int


class Qwen2Model:
    """Weights and forward for one tensor-parallel rank (the whole model when tp_size == 1).

    `fmt` is the weight format (kernels.FORMATS); activations and the KV pool use
    kernels.compute_dtype(fmt). Each weight starts with its format's plain kernel;
    `use_kernels` installs the calibrated ones. `head_ids` (a draft's proposal vocabulary,
    specdec.vocab.proposal_ids) keeps only those rows of the vocabulary head; the others'
    logits are OUTSIDE_HEAD_LOGIT."""

    def __init__(self, model_dir, *, fmt: str = "bfloat16", device="cpu", tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, head_ids: Sequence[int] | None = None):
        self.model_dir = Path(model_dir)
        self.head_ids = None if head_ids is None else torch.tensor(head_ids, dtype=torch.long,
                                                                   device=device)
        self.config = cfg = ModelConfig.from_dir(model_dir)
        if fmt not in kernels.FORMATS:
            raise ValueError(f"weight format {fmt!r}: use one of {kernels.FORMATS}")
        self.format = fmt
        self.dtype, self.device = kernels.compute_dtype(fmt), torch.device(device)
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
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
            return t.to(device=self.device)

        def small(t):  # norms and biases stay in the activation dtype
            return None if t is None else t.to(self.dtype).contiguous()

        def matrix(ts):  # q, k and v (and gate, up) are fused so that each is one matmul
            return Weight(torch.cat(ts, 0) if isinstance(ts, list) else ts, self.format)

        def cat(ts):
            return torch.cat(ts, 0) if all(t is not None for t in ts) else None

        embed = get("model.embed_tokens.weight")
        self.embed = embed.to(self.dtype).contiguous()
        self.layers = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(dict(
                ln1=small(get(p + "input_layernorm.weight")),
                ln2=small(get(p + "post_attention_layernorm.weight")),
                qkv=matrix([get(a + f"{x}_proj.weight", 0) for x in "qkv"]),
                qkv_bias=small(cat([get(a + f"{x}_proj.bias", 0, optional=True) for x in "qkv"])),
                o=matrix(get(a + "o_proj.weight", 1)),
                o_bias=small(get(a + "o_proj.bias", optional=True)),
                gate_up=matrix([get(m + "gate_proj.weight", 0), get(m + "up_proj.weight", 0)]),
                down=matrix(get(m + "down_proj.weight", 1)),
            ))
        self.norm = small(get("model.norm.weight"))
        head = get("lm_head.weight", optional=True)
        head = embed if head is None else head  # tied or not
        self.lm_head = Weight(head if self.head_ids is None else head[self.head_ids], self.format)
        handles.clear()

    def weights(self) -> list[Weight]:
        return [w for layer in self.layers for w in layer.values() if isinstance(w, Weight)] + [self.lm_head]

    def weight_shapes(self) -> dict[tuple[int, int], int]:
        """Distinct weight shapes -> how many matmuls of that shape one forward runs."""
        counts: dict[tuple[int, int], int] = {}
        for w in self.weights():
            counts[w.shape] = counts.get(w.shape, 0) + 1
        return counts

    def use_kernels(self, chosen: dict[tuple[int, int], Kernel]) -> None:
        for w in self.weights():
            w.kernel = chosen[w.shape]

    # ------------------------------------------------------------------ pieces

    def new_pool(self, num_blocks: int) -> KVPool:
        c = self.config
        return KVPool(c.num_layers, num_blocks, self.kv_heads, c.head_dim, self.dtype, self.device)

    def _row_parallel(self, x, w: Weight, b=None):
        out = w(x)
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

    def _attention(self, i, layer, x, cos, sin, pool: KVPool, plan):
        H, KV, D = self.heads, self.kv_heads, self.config.head_dim
        qkv = layer["qkv"](x, layer["qkv_bias"])  # [T, (H + 2 KV) D]
        q, k, v = qkv.split([H * D, KV * D, KV * D], -1)
        q = self._apply_rope(q.view(-1, H, D), cos, sin)
        k = self._apply_rope(k.view(-1, KV, D), cos, sin)
        out = paged_attention(q, k, v.view(-1, KV, D), pool.k[i], pool.v[i], plan)  # [T, H, D]
        return self._row_parallel(out.reshape(-1, H * D), layer["o"], layer["o_bias"])

    def _mlp(self, layer, x):
        gate, up = layer["gate_up"](x).chunk(2, -1)
        return self._row_parallel(F.silu(gate) * up, layer["down"])

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, pool: KVPool,
                segments: Sequence[Segment], logit_rows: torch.Tensor) -> torch.Tensor:
        """Feeds `tokens` [T] at `positions` [T] (rows grouped by `segments`, whose block
        tables must cover start + length; the pool receives the new keys / values) and
        returns float32 logits [len(logit_rows), vocab] for the selected rows."""
        plan = plan_attention(segments, self.device)
        x = F.embedding(tokens, self.embed)  # [T, hidden]
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, self._rms_norm(x, layer["ln1"]), cos, sin, pool, plan)
            x = x + self._mlp(layer, self._rms_norm(x, layer["ln2"]))
        h = self._rms_norm(x[logit_rows], self.norm)
        if self.head_ids is None:
            return self.lm_head(h).float()
        logits = h.new_full((h.shape[0], self.config.vocab_size), OUTSIDE_HEAD_LOGIT, dtype=torch.float32)
        logits[:, self.head_ids] = self.lm_head(h).float()
        return logits

    def weight_bytes(self) -> int:
        """Bytes of weights this rank reads per forward (for bandwidth figures)."""
        small = [self.norm] + [t for layer in self.layers for t in layer.values()
                               if isinstance(t, torch.Tensor)]
        return sum(w.nbytes for w in self.weights()) + sum(t.numel() * t.element_size() for t in small)


def load_model(model_dir, *, fmt: str = "bfloat16", device="cpu",
               tp: TensorParallel | None = None, head_ids: Sequence[int] | None = None) -> Qwen2Model:
    tp = tp or TensorParallel()
    return Qwen2Model(model_dir, fmt=fmt, device=device, tp_rank=tp.rank, tp_size=tp.size,
                      tp_group=tp.group, head_ids=head_ids)


def parse_format(dtype) -> str:
    """A dtype name (or torch dtype) -> weight format name; 'auto' passes through."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}.get(dtype, str(dtype))
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
             "int8": "int8", "float16": "float16", "fp16": "float16", "w8a8": "w8a8", "auto": "auto"}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(names)}")
    return names[dtype]
