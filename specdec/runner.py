"""ModelRunner: requests' KV caches in one paged pool over our compact forward
(docs/ARCHITECTURE.md).

Every call carries the full token list a request must condition on; the cache is only a
cache. The runner reuses the longest cached prefix, drops the rest (how rejected proposals
leave the cache, and how a replica that never saw a request re-prefills), and feeds the new
tokens of all requests in one forward pass. Capacity is counted in pool blocks of
BLOCK_SIZE positions; least recently used requests outside a call are evicted for it.

At load the runner picks its weight format (`dtype="auto"`) and each weight shape's matmul
kernel by measurement on this machine (specdec/kernels.py), and reports the choice.

With tensor parallelism every rank holds a ModelRunner and must receive the same calls in
the same order; all cache decisions (reuse, eviction, block allocation) are deterministic
functions of the call sequence, so the ranks' caches stay in step.

Longer than 300 lines because the kernel choice that the runner reports (KernelChoice)
lives beside the cache bookkeeping it configures.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specdec import attention, kernels
from specdec.attention import BLOCK_SIZE
from specdec.errors import CapacityError, ContextLengthError, RequestError
from specdec.kernels import Kernel
from specdec.model import ModelConfig, Segment, TensorParallel, load_model, parse_format
from specdec.vocab import proposal_ids

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHE_TOKENS = 65_536
# A seed-safe configuration costing more than this many times the fastest is said plainly.
EXPENSIVE_INVARIANCE = 1.25


def matmul_shapes(config: ModelConfig, tp_size: int = 1,
                  head_rows: int | None = None) -> dict[tuple[int, int], int]:
    """The [out, in] shapes of one rank's weight matrices -> matmuls per forward
    (`head_rows`: a pruned vocabulary head's)."""
    c, D = config, config.head_dim
    qkv = ((c.num_heads + 2 * c.num_kv_heads) * D // tp_size, c.hidden_size)
    o = (c.hidden_size, c.num_heads * D // tp_size)
    gate_up = (2 * c.intermediate_size // tp_size, c.hidden_size)
    down = (c.hidden_size, c.intermediate_size // tp_size)
    counts: dict[tuple[int, int], int] = {}
    for shape in [qkv, o, gate_up, down] * c.num_layers + [(head_rows or c.vocab_size, c.hidden_size)]:
        counts[shape] = counts.get(shape, 0) + 1
    return counts


@dataclass
class KernelChoice:
    """What the calibration chose for one runner, as reported in logs, replica state,
    metrics and the benchmark JSON."""

    format: str
    batch_invariant: bool
    kernels: dict[str, str]  # "out x in" -> kernel name
    forward_ms: list[float]  # estimated matmul ms per forward at kernels.COST_ROWS
    fastest_forward_ms: list[float]  # the same with the fastest kernels, invariant or not
    invariant_ok: bool  # every shape had a kernel that passed the bitwise check
    formats_ms: dict[str, list[float]] = field(default_factory=dict)  # dtype=auto's candidates
    machine: str = field(default_factory=kernels.machine_key)

    @property
    def invariance_cost(self) -> float:
        return kernels.profile_sum(self.forward_ms) / max(kernels.profile_sum(self.fastest_forward_ms), 1e-9)

    def to_dict(self) -> dict:
        return dict(format=self.format, batch_invariant=self.batch_invariant, kernels=self.kernels,
                    forward_ms={r: round(m, 2) for r, m in zip(kernels.COST_ROWS, self.forward_ms)},
                    fastest_forward_ms={r: round(m, 2) for r, m in
                                        zip(kernels.COST_ROWS, self.fastest_forward_ms)},
                    invariance_cost=round(self.invariance_cost, 3), invariant_ok=self.invariant_ok,
                    formats_ms={f: [round(m, 2) for m in ms] for f, ms in self.formats_ms.items()},
                    machine=self.machine)


def auto_formats(draft: bool) -> tuple[str, ...]:
    """What dtype=auto chooses among: a draft may take formats that quantize activations (its
    numbers change acceptance only), a target keeps its activations."""
    return tuple(f for f in kernels.FORMATS if draft or f not in kernels.DRAFT_ONLY_FORMATS)


def choose_format(shapes: dict[tuple[int, int], int], device, batch_invariant: bool,
                  formats=None, draft: bool = False) -> tuple[str, dict[str, list[float]]]:
    """dtype=auto: the weight format whose (invariant, when asked) matmuls are fastest over
    the profile rows (a decode, a K+1-row verify, a batch) on this machine, among `formats`
    (default: auto_formats(draft)). GPUs: bf16."""
    if torch.device(device).type != "cpu":
        return "bfloat16", {}
    formats = auto_formats(draft) if formats is None else formats
    estimates = {}
    for fmt in formats:
        est = kernels.forward_ms(kernels.calibrate(list(shapes), fmt), shapes, batch_invariant)
        if est is not None:
            estimates[fmt] = est
    best = min(estimates, key=lambda f: kernels.profile_sum(estimates[f]))
    return best, estimates


def planned_weights(model_dir, tp_size: int = 1, proposal_vocab: int | None = None
                    ) -> tuple[list[int] | None, dict[tuple[int, int], int]]:
    """What a rank will load, before loading it: the vocabulary head rows it keeps (None:
    all; else a draft's proposal vocabulary) and its matmul shapes (matmul_shapes)."""
    config = ModelConfig.from_dir(model_dir)
    head = None if proposal_vocab is None else proposal_ids(model_dir, proposal_vocab, config.vocab_size)
    return head, matmul_shapes(config, tp_size, head and len(head))


def resolve_format(model_dir, dtype, device, batch_invariant: bool, tp_size: int = 1,
                   proposal_vocab: int | None = None, draft: bool = False) -> str:
    """A concrete weight format for `dtype` ('auto' measured here). Tensor-parallel ranks
    must agree: the replica resolves it once and hands every rank the result."""
    fmt = parse_format(dtype)
    if fmt != "auto":
        return fmt
    _, shapes = planned_weights(model_dir, tp_size, proposal_vocab)
    return choose_format(shapes, device, batch_invariant, draft=draft)[0]


def choose_kernels(shapes: dict[tuple[int, int], int], fmt: str, device,
                   batch_invariant: bool) -> tuple[dict[tuple[int, int], Kernel], KernelChoice]:
    if torch.device(device).type != "cpu":  # GPU: fixed 16-row blocks keep GEMMs invariant
        block = 16 if batch_invariant else None
        chosen = {s: Kernel(fmt, "linear", block) for s in shapes}
        return chosen, KernelChoice(fmt, batch_invariant, {f"{s[0]}x{s[1]}": k.name for s, k in chosen.items()},
                                    [], [], True)
    cal = kernels.calibrate(list(shapes), fmt)
    fastest = kernels.forward_ms(cal, shapes, invariant=False)
    invariant = kernels.forward_ms(cal, shapes, invariant=True)
    invariant_ok = invariant is not None
    chosen = {}
    for s, c in cal.items():
        name = c.fastest_invariant if batch_invariant and c.fastest_invariant else c.fastest
        chosen[s] = c.kernel(name)
    est = (invariant if batch_invariant and invariant_ok else fastest)
    return chosen, KernelChoice(fmt, batch_invariant, {f"{s[0]}x{s[1]}": k.name for s, k in chosen.items()},
                                est, fastest, invariant_ok)


def _report(choice: KernelChoice, model_dir, device) -> None:
    logger.info("%s: weights %s, kernels %s, est. matmul ms at rows %s: %s; attention %s",
                Path(model_dir).name, choice.format, choice.kernels, kernels.COST_ROWS,
                [round(m, 1) for m in choice.forward_ms], attention.implementation(device.type))
    if choice.batch_invariant and not choice.invariant_ok:
        logger.warning("batch_invariant: NO matmul kernel passed the bitwise invariance check "
                       "on this machine for some weight shape; seeded outputs may depend on the "
                       "batch. Kernels: %s", choice.kernels)
    elif choice.batch_invariant and choice.invariance_cost > EXPENSIVE_INVARIANCE:
        logger.warning("batch_invariant costs %.2fx the fastest matmuls on this machine",
                       choice.invariance_cost)


@dataclass
class _Sequence:
    tokens: list[int]  # what the cache holds, position by position
    blocks: list[int]  # pool blocks holding positions 16 i .. 16 i + 15


@dataclass
class _Step:
    request_id: str
    tokens: list[int]
    num_logits: int
    reuse: int  # cached positions kept


def _blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)


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
    does). `batch_invariant=True` uses, for every weight shape, the cheapest matmul kernel
    that passed the calibration's bitwise check, so that a position's logits depend neither
    on which other requests share the forward pass nor on how many of its own positions are
    fed together (prefill, verify, decode); the attention is invariant in both modes.
    `proposal_vocab` (drafts only) keeps that many token ids in the vocabulary head
    (specdec.vocab.proposal_ids); the others' logits are model.OUTSIDE_HEAD_LOGIT.
    `kernels` overrides the calibration ({shape: Kernel}), e.g. to bypass it in tests.
    `draft`: this runner proposes tokens, so dtype=auto may choose a format that quantizes
    activations (kernels.DRAFT_ONLY_FORMATS)."""

    def __init__(self, model_dir, *, dtype="bfloat16", device="cpu",
                 max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS,
                 tp: TensorParallel | None = None, batch_invariant: bool = False,
                 kernels: dict[tuple[int, int], Kernel] | None = None,
                 proposal_vocab: int | None = None, draft: bool = False):
        self.model_dir = Path(model_dir)  # a model folder: callers resolve names first
        tp = tp or TensorParallel()
        head, shapes = planned_weights(self.model_dir, tp.size, proposal_vocab)
        fmt, formats_ms = parse_format(dtype), {}
        if fmt == "auto":
            fmt, formats_ms = choose_format(shapes, device, batch_invariant, draft=draft)
        self.model = load_model(self.model_dir, fmt=fmt, device=device, tp=tp, head_ids=head)
        self.proposal_vocab = None if head is None else len(head)
        chosen, self.kernel_choice = choose_kernels(shapes, fmt, device, batch_invariant)
        self.kernel_choice.formats_ms = formats_ms
        self.model.use_kernels(kernels or chosen)
        if kernels:
            self.kernel_choice.kernels = {f"{s[0]}x{s[1]}": k.name for s, k in kernels.items()}
        _report(self.kernel_choice, self.model_dir, self.model.device)
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        self.max_context = self.config.max_position_embeddings
        self.max_cache_tokens = int(max_cache_tokens)
        self.batch_invariant = batch_invariant
        self.num_blocks = _blocks_for(self.max_cache_tokens)
        self.pool = self.model.new_pool(self.num_blocks + 1)  # block 0: the zero block
        self._free = list(range(self.num_blocks, 0, -1))  # pop() hands out low blocks first
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
            seq = self._seqs.pop(request_id, None)
            if seq is not None:
                self._free_blocks(seq.blocks)

    def cache_usage(self) -> dict:
        with self._lock:
            used = self.num_blocks - len(self._free)
            return dict(sequences=len(self._seqs),
                        tokens=sum(len(s.tokens) for s in self._seqs.values()),
                        capacity_tokens=used * BLOCK_SIZE, max_cache_tokens=self.max_cache_tokens,
                        blocks_used=used, blocks_total=self.num_blocks, block_size=BLOCK_SIZE,
                        pool_bytes=self.pool.nbytes)

    def calibration(self) -> dict:
        return dict(self.kernel_choice.to_dict(), proposal_vocab=self.proposal_vocab,
                    attention=attention.implementation(self.model.device.type))

    def set_batch_invariant(self, on: bool) -> None:
        """Switches the mode on a loaded runner (the calibration is cached: no reload)."""
        shapes = self.model.weight_shapes()
        chosen, choice = choose_kernels(shapes, self.model.format, self.model.device, on)
        choice.formats_ms = self.kernel_choice.formats_ms
        with self._lock:
            self.model.use_kernels(chosen)
            self.kernel_choice, self.batch_invariant = choice, on

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
        """Evicts least recently used requests outside this call until its blocks fit."""
        need = sum(_blocks_for(len(s.tokens)) for s in steps)
        if need > self.num_blocks:
            tokens = sum(len(s.tokens) for s in steps)
            raise CapacityError(
                f"this call needs {need} cache blocks ({tokens} tokens) for {len(steps)} "
                f"request(s), more than the pool's {self.num_blocks} blocks of {BLOCK_SIZE} "
                f"(max_cache_tokens={self.max_cache_tokens}); send fewer or shorter requests "
                "per call, or raise max_cache_tokens")
        in_call = {s.request_id for s in steps}
        held = sum(len(self._seqs[s.request_id].blocks) for s in steps if s.request_id in self._seqs)
        for rid in [r for r in self._seqs if r not in in_call]:
            if len(self._free) + held >= need:
                break
            self._free_blocks(self._seqs.pop(rid).blocks)

    def _free_blocks(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def _take_block(self) -> int:
        block = self._free.pop()
        span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
        self.pool.k[:, span] = 0  # finite values in the slots masked out until written
        self.pool.v[:, span] = 0
        return block

    def _run(self, steps: list[_Step]) -> list[torch.Tensor]:
        tokens, positions, segments, logit_rows = [], [], [], []
        for step in steps:
            seq = self._seqs.get(step.request_id)
            if seq is None:
                seq = self._seqs[step.request_id] = _Sequence([], [])
            self._seqs.move_to_end(step.request_id)
            # Crop first: if the forward fails, the cache still describes seq.tokens.
            seq.tokens = seq.tokens[: step.reuse]
            keep = _blocks_for(len(step.tokens))
            self._free_blocks(seq.blocks[keep:])
            del seq.blocks[keep:]
            while len(seq.blocks) < keep:
                seq.blocks.append(self._take_block())
            n = len(step.tokens) - step.reuse
            if n:
                segments.append(Segment(seq.blocks, step.reuse, n))
            row = len(tokens) + n
            logit_rows.extend(range(row - step.num_logits, row))
            tokens.extend(step.tokens[step.reuse :])
            positions.extend(range(step.reuse, len(step.tokens)))
        if tokens:
            dev = self.model.device
            as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
            logits = self.model.forward(as_long(tokens), as_long(positions), self.pool, segments,
                                        as_long(logit_rows))
        else:
            logits = torch.empty(0, self.vocab_size)
        for step in steps:
            self._seqs[step.request_id].tokens = step.tokens
        return list(logits.split([s.num_logits for s in steps]))
