"""Attention over a paged KV pool for every request and position of a forward pass at once,
with each row's result independent of how rows are batched: a row's output is the same bits
whether it is computed in a prefill, a K+1-row verify, a re-prefill after failover or a
one-row decode, and whoever else is in the batch (the rule the sampler's seeds rely on).

The pool holds keys and values in blocks of BLOCK_SIZE positions; a request owns a list of
blocks (its block table). Two implementations, chosen once per process (`implementation`):

- `native` (CPU): specdec/native/paged_attention.c, one call per layer. Each (row, head) is
  computed alone, key by key in position order, so its bits depend on its own position and
  keys only. Built on first use with the machine's C compiler.
- `torch` (GPUs, or a CPU without a C compiler, or SPECDEC_ATTENTION=torch): a forward's new
  rows are cut, per request, into query blocks of QUERY_BLOCK rows (the last one padded). A
  query block attends to its request's key blocks 0..n-1; every (query block, key block)
  pair is one fixed-shape matrix product [G * QUERY_BLOCK, D] x [D, BLOCK_SIZE] (G query
  heads per KV head), masked by position. The softmax takes the exact maximum over all keys,
  and the key blocks' partial sums are added in a fixed pairwise tree (missing blocks of a
  shorter request add exact zeros). Per layer this is a fixed number of tensor operations
  (plus one sum per doubling of the longest request's key blocks), whatever the number of
  requests and rows.

The two give different bits (both are exact to float32 rounding); a process uses one for
every call, and its replicas on one kind of machine make the same choice.
`AttentionPlan` computes the index tensors once per forward and every layer reuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Sequence

import torch

from specdec import native

BLOCK_SIZE = 16  # positions per KV block (and per key chunk of the torch formulation)
QUERY_BLOCK = 4  # rows per query block: a decode pads 1 row to 4, a K=3 verify fills one
MAX_UNITS = 8192  # (query block, key block) pairs computed together; bounds a long prefill
# (row, head, key) triples below which the native call stays on one thread: starting
# threads costs tens of microseconds, a decode's whole attention a few.
NATIVE_THREAD_MIN_WORK = 1 << 18


@cache
def implementation(device_type: str = "cpu") -> str:
    """'native' where the compiled attention loads (CPU tensors), else 'torch'."""
    if device_type == "cpu" and native.load() is not None:
        return "native"
    return "torch"


@dataclass
class _Group:
    rows: torch.Tensor  # [nb * QUERY_BLOCK] row index into the forward's rows (pads -> T)
    keys: torch.Tensor  # [nb, P] pool block of each key chunk (0, the zero block, past the end)
    hidden: torch.Tensor  # [nb, P, 1, 1, QUERY_BLOCK, BLOCK_SIZE] key not visible to the row
    chunks: int  # P


@dataclass
class _RowTables:
    """What the native attention reads: each row's position and block table."""

    positions: torch.Tensor  # [T] int64
    table_of_row: torch.Tensor  # [T] int64 offset of the row's block table in `tables`
    tables: torch.Tensor  # int64, the requests' block tables one after another
    max_keys: int  # keys of the longest row


@dataclass
class AttentionPlan:
    """Index tensors for one forward pass, shared by all layers: `rows` for the native
    implementation, `groups` for the torch one."""

    num_rows: int
    slots: torch.Tensor  # [T] flat pool slot where each new row's key / value goes
    groups: list[_Group]
    rows: _RowTables | None = None


def plan_attention(segments: Sequence[tuple[Sequence[int], int, int]], device) -> AttentionPlan:
    """segments: (block_table, start, length) per request, rows consecutive in this order."""
    device = torch.device(device)
    slots = []
    for table, start, length in segments:
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + length)]
    num_rows = len(slots)
    slots_t = torch.tensor(slots, dtype=torch.long, device=device)
    if implementation(device.type) == "native":
        return AttentionPlan(num_rows, slots_t, [], _row_tables(segments))
    return AttentionPlan(num_rows, slots_t, _groups(segments, num_rows, device))


def _row_tables(segments) -> _RowTables:
    positions, table_of_row, tables = [], [], []
    for table, start, length in segments:
        needed = list(table[: (start + length - 1) // BLOCK_SIZE + 1])
        positions += range(start, start + length)
        table_of_row += [len(tables)] * length
        tables += needed
    return _RowTables(torch.tensor(positions, dtype=torch.long), torch.tensor(table_of_row, dtype=torch.long),
                      torch.tensor(tables or [0], dtype=torch.long), max(positions, default=0) + 1)


def _groups(segments, num_rows: int, device) -> list[_Group]:
    blocks = []  # (row indices, positions, block table) of each query block
    row = 0
    for table, start, length in segments:
        for b in range(0, length, QUERY_BLOCK):
            n = min(QUERY_BLOCK, length - b)
            blocks.append((list(range(row + b, row + b + n)), [start + b + j for j in range(n)], table))
        row += length
    groups, current, units = [], [], 0
    for blk in blocks:
        need = blk[1][-1] // BLOCK_SIZE + 1
        if current and (len(current) + 1) * max(units, need) > MAX_UNITS:
            groups.append(_make_group(current, num_rows, device))
            current, units = [], 0
        current.append(blk)
        units = max(units, need)
    if current:
        groups.append(_make_group(current, num_rows, device))
    return groups


def _make_group(blocks, num_rows: int, device) -> _Group:
    chunks = max(pos[-1] // BLOCK_SIZE + 1 for _, pos, _ in blocks)
    rows, keys, qpos = [], [], []
    for idx, pos, table in blocks:
        pad = QUERY_BLOCK - len(idx)
        rows += idx + [num_rows] * pad  # pad rows read a zero row and see key 0 only
        qpos.append(pos + [0] * pad)
        n = pos[-1] // BLOCK_SIZE + 1
        keys.append(list(table[:n]) + [0] * (chunks - n))
    qpos_t = torch.tensor(qpos, device=device)  # [nb, Q]
    kpos = torch.arange(chunks * BLOCK_SIZE, device=device).view(chunks, BLOCK_SIZE)
    hidden = kpos[None, :, None, :] > qpos_t[:, None, :, None]  # [nb, P, Q, S]
    return _Group(torch.tensor(rows, device=device), torch.tensor(keys, device=device),
                  hidden[:, :, None, None], chunks)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q [T, H, D], k_new / v_new [T, KV, D] at the plan's positions; k_pool / v_pool
    [num_blocks * BLOCK_SIZE, KV, D] (one layer) receive the new keys / values. Returns the
    attention output [T, H, D] in q's dtype, computed in float32."""
    k_pool.index_copy_(0, plan.slots, k_new.to(k_pool.dtype))
    v_pool.index_copy_(0, plan.slots, v_new.to(v_pool.dtype))
    if plan.rows is not None:
        return _native_attention(q, k_pool, v_pool, plan.rows)
    T, H, D = q.shape
    KV = k_new.shape[1]
    G = H // KV
    q_rows = torch.cat([q.float() * (1.0 / math.sqrt(D)), q.new_zeros(1, H, D, dtype=torch.float32)])
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=q.device)
    k_blocks = k_pool.view(-1, BLOCK_SIZE, KV, D)
    v_blocks = v_pool.view(-1, BLOCK_SIZE, KV, D)
    for g in plan.groups:
        out.index_copy_(0, g.rows, _attend_group(q_rows, k_blocks, v_blocks, g, KV, G, D))
    return out[:T].to(q.dtype)


def _native_attention(q, k_pool, v_pool, rows: _RowTables) -> torch.Tensor:
    T, H, D = q.shape
    KV = k_pool.shape[1]
    if k_pool.dtype not in (torch.float32, torch.bfloat16) or not k_pool.is_contiguous():
        raise ValueError(f"native attention: a contiguous float32 / bfloat16 pool, not {k_pool.dtype}")
    scaled = (q.float() * (1.0 / math.sqrt(D))).contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32)
    work = T * H * rows.max_keys
    threads = torch.get_num_threads() if work >= NATIVE_THREAD_MIN_WORK else 1
    status = native.load()(
        scaled.data_ptr(), T, H, D, k_pool.data_ptr(), v_pool.data_ptr(),
        int(k_pool.dtype == torch.bfloat16), KV, BLOCK_SIZE, rows.positions.data_ptr(),
        rows.table_of_row.data_ptr(), rows.tables.data_ptr(), rows.max_keys, out.data_ptr(), threads)
    if status != 0:
        raise RuntimeError(f"native attention failed (status {status}: -1 out of memory, "
                           "-2 BLOCK_SIZE not a power of two)")
    return out.to(q.dtype)


def _sum_key_blocks(o: torch.Tensor) -> torch.Tensor:
    """o [nb, P, ...] summed over the P key blocks as a pairwise tree over P zero-padded to a
    power of two: each level adds aligned pairs, so the sum of a request's blocks (those past
    its end are exact zeros) has the same bits whatever the longest request of the call, in
    log2(P) tensor operations instead of P."""
    width = 1 << (o.shape[1] - 1).bit_length()
    if width > o.shape[1]:
        o = torch.cat([o, o.new_zeros(o.shape[0], width - o.shape[1], *o.shape[2:])], 1)
    while o.shape[1] > 1:  # a sum over a pair is one addition: exact order
        o = o.view(o.shape[0], o.shape[1] // 2, 2, *o.shape[2:]).sum(2)
    return o[:, 0]


def _attend_group(q_rows, k_blocks, v_blocks, g: _Group, KV: int, G: int, D: int) -> torch.Tensor:
    Q, S, P = QUERY_BLOCK, BLOCK_SIZE, g.chunks
    nb = g.keys.shape[0]
    q = q_rows[g.rows].view(nb, Q, KV, G, D).permute(0, 2, 3, 1, 4).reshape(nb, 1, KV, G * Q, D)
    k = k_blocks[g.keys].float().permute(0, 1, 3, 4, 2)  # [nb, P, KV, D, S]
    v = v_blocks[g.keys].float().permute(0, 1, 3, 2, 4)  # [nb, P, KV, S, D]
    v = torch.cat([v, v.new_ones(nb, P, KV, S, 1)], -1)  # the ones column sums the weights
    s = torch.matmul(q, k).view(nb, P, KV, G, Q, S)  # [nb, P, KV, G, Q, S]
    s = s.masked_fill(g.hidden, float("-inf"))
    m = s.amax(dim=(1, 5), keepdim=True)  # exact: the maximum has no rounding
    p = torch.exp(s - m).view(nb, P, KV, G * Q, S)
    o = torch.matmul(p, v)  # [nb, P, KV, G * Q, D + 1]
    acc = _sum_key_blocks(o)
    out = acc[..., :D] / acc[..., D:]  # [nb, KV, G * Q, D]
    return out.view(nb, KV, G, Q, D).permute(0, 3, 1, 2, 4).reshape(nb * Q, KV * G, D)
