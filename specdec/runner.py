"""ModelRunner: per-request KV caches over our compact forward (docs/ARCHITECTURE.md).

Every call carries the full token list a request must condition on; the cache is only a
cache. The runner reuses the longest cached prefix, drops the rest (how rejected proposals
leave the cache, and how a replica that never saw a request re-prefills), and feeds the new
tokens of all requests in one forward pass.

With tensor parallelism every rank holds a ModelRunner and must receive the same calls in
the same order; all cache decisions (reuse, eviction) are deterministic functions of the
call sequence, so the ranks' caches stay in step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specdec.errors import CapacityError, ContextLengthError, RequestError
from specdec.model import KVCache, Segment, TensorParallel, load_model, parse_dtype

DEFAULT_MAX_CACHE_TOKENS = 65_536


def default_row_block(device, dtype) -> int:
    """Rows per matmul block in batch-invariant mode. On CPU, bf16 / fp16 matmuls cost in
    proportion to their rows (measured on an AVX2 machine), so padding only wastes: one row
    per block. Elsewhere (fp32 on CPU, GPUs) a wider block keeps big matmuls efficient."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return 1
    return 16


@dataclass
class _Sequence:
    tokens: list[int]  # what the cache holds, position by position
    cache: KVCache


@dataclass
class _Step:
    request_id: str
    tokens: list[int]
    num_logits: int
    reuse: int  # cached positions kept


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    lo, hi = 0, n  # largest k with a[:k] == b[:k]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ModelRunner:
    """Runs one model (or one tensor-parallel rank of it) over many requests' KV caches.

    Not re-entrant: one caller at a time (a lock serialises calls; the deployment already
    does). `batch_invariant=True` computes every matmul in fixed blocks of `row_block` rows and
    each position's attention as a one-row decode step would, so that a position's logits
    depend neither on which other requests share the forward pass nor on how many of its own
    positions are fed together (prefill, verify, decode). Measured on the 2-core AVX2 machine: bf16 matmul rows
    were already independent of the batch (bitwise, 1..1024 rows), fp32 ones were not (1-3
    rows vs 4+ differ), so the mode matters for fp32 and for other backends."""

    def __init__(self, model_dir, *, dtype="bfloat16", device="cpu",
                 max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS,
                 tp: TensorParallel | None = None, batch_invariant: bool = False,
                 row_block: int | None = None):
        self.model_dir = Path(model_dir)  # a model folder: callers resolve names first
        dtype = parse_dtype(dtype)
        if batch_invariant:
            row_block = row_block or default_row_block(device, dtype)
        self.model = load_model(self.model_dir, dtype=dtype, device=device, tp=tp,
                                row_block=row_block if batch_invariant else None)
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        self.max_context = self.config.max_position_embeddings
        self.max_cache_tokens = int(max_cache_tokens)
        self.batch_invariant = batch_invariant
        self._seqs: OrderedDict[str, _Sequence] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public

    def extend(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[torch.Tensor]:
        """(request_id, token_ids, num_logits) per item: afterwards the cache of request_id
        holds exactly token_ids; returns float32 logits [num_logits, vocab] for its last
        num_logits positions, in item order."""
        with self._lock:
            steps = self._plan(items)
            self._make_room(steps)
            return self._run(steps)

    def release(self, request_id) -> None:
        with self._lock:
            self._seqs.pop(request_id, None)

    def cache_usage(self) -> dict:
        with self._lock:
            return dict(sequences=len(self._seqs),
                        tokens=sum(len(s.tokens) for s in self._seqs.values()),
                        capacity_tokens=sum(s.cache.capacity for s in self._seqs.values()),
                        max_cache_tokens=self.max_cache_tokens)

    # ------------------------------------------------------------------ steps

    def _plan(self, items) -> list[_Step]:
        """Validates every item before anything changes, and picks the reused prefix."""
        steps, seen = [], set()
        for request_id, token_ids, num_logits in items:
            tokens = [int(t) for t in token_ids]
            if request_id in seen:
                raise RequestError(f"request {request_id!r} appears twice in one call")
            seen.add(request_id)
            if not tokens:
                raise RequestError(f"request {request_id!r}: empty token list")
            if len(tokens) > self.max_context:
                raise ContextLengthError(
                    f"request {request_id!r}: {len(tokens)} tokens exceed the model's context "
                    f"of {self.max_context}")
            if min(tokens) < 0 or max(tokens) >= self.vocab_size:
                raise RequestError(f"request {request_id!r}: token ids must lie in "
                                   f"[0, {self.vocab_size})")
            if not 0 <= num_logits <= len(tokens):
                raise RequestError(f"request {request_id!r}: num_logits={num_logits} not in "
                                   f"[0, {len(tokens)}]")
            seq = self._seqs.get(request_id)
            cached = _common_prefix(seq.tokens, tokens) if seq else 0
            # Positions whose logits are wanted are fed again even if cached.
            steps.append(_Step(request_id, tokens, num_logits,
                               min(cached, len(tokens) - num_logits)))
        return steps

    def _make_room(self, steps: list[_Step]) -> None:
        """Evicts least recently used requests outside this call until it fits."""
        need = sum(len(s.tokens) for s in steps)
        if need > self.max_cache_tokens:
            raise CapacityError(
                f"this call needs {need} cache tokens for {len(steps)} request(s), more than "
                f"max_cache_tokens={self.max_cache_tokens}; send fewer or shorter requests "
                "per call, or raise max_cache_tokens")
        in_call = {s.request_id for s in steps}
        others = sum(len(q.tokens) for r, q in self._seqs.items() if r not in in_call)
        for rid in [r for r in self._seqs if r not in in_call]:
            if others + need <= self.max_cache_tokens:
                break
            others -= len(self._seqs.pop(rid).tokens)

    def _run(self, steps: list[_Step]) -> list[torch.Tensor]:
        tokens, positions, segments, logit_rows = [], [], [], []
        for step in steps:
            seq = self._seqs.get(step.request_id)
            if seq is None:
                seq = self._seqs[step.request_id] = _Sequence([], self.model.new_cache())
            self._seqs.move_to_end(step.request_id)
            # Crop first: if the forward fails, the cache still describes seq.tokens.
            seq.tokens = seq.tokens[: step.reuse]
            seq.cache.length = step.reuse
            n = len(step.tokens) - step.reuse
            seq.cache.reserve(len(step.tokens))
            if n:
                segments.append(Segment(seq.cache, step.reuse, n))
            row = len(tokens) + n
            logit_rows.extend(range(row - step.num_logits, row))
            tokens.extend(step.tokens[step.reuse :])
            positions.extend(range(step.reuse, len(step.tokens)))
        if tokens:
            dev = self.model.device
            as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
            logits = self.model.forward(as_long(tokens), as_long(positions), segments,
                                        as_long(logit_rows))
        else:
            logits = torch.empty(0, self.vocab_size)
        for step in steps:
            seq = self._seqs[step.request_id]
            seq.tokens = step.tokens
            seq.cache.length = len(step.tokens)
        return list(logits.split([s.num_logits for s in steps]))
