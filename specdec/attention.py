"""Attention over a paged KV pool for every request and position of a forward pass at once,
with each row's result independent of how rows are batched.

The pool holds keys and values in blocks of BLOCK_SIZE positions; a request owns a list of
blocks (its block table). A forward's new rows are cut, per request, into query blocks of
QUERY_BLOCK rows (the last one padded). A query block attends to its request's key blocks
0..n-1; every (query block, key block) pair is one fixed-shape matrix product
[G * QUERY_BLOCK, D] x [D, BLOCK_SIZE] (G query heads per KV head), masked by position. The
softmax takes the exact maximum over all keys, and the key blocks' partial sums are added in
a fixed pairwise tree (missing blocks of a shorter request add exact zeros). So a row's output is the
same bits whether it is computed in a prefill, a K+1-row verify, a re-prefill after failover
or a one-row decode, and whoever else is in the batch: the rule the sampler's seeds rely on.

Per layer this is a fixed number of tensor operations (plus one sum per doubling of the
longest request's key blocks), whatever the number of requests and rows: `AttentionPlan` computes the
index tensors once per forward and every layer reuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

BLOCK_SIZE = 16  # positions per KV block (and per key chunk of the attention)
QUERY_BLOCK = 4  # rows per query block: a decode pads 1 row to 4, a K=3 verify fills one
MAX_UNITS = 8192  # (query block, key block) pairs computed together; bounds a long prefill


@dataclass
class _Group:
    rows: torch.Tensor  # [nb * QUERY_BLOCK] row index into the forward's rows (pads -> T)
    keys: torch.Tensor  # [nb, P] pool block of each key chunk (0, the zero block, past the end)
    hidden: torch.Tensor  # [nb, P, 1, 1, QUERY_BLOCK, BLOCK_SIZE] key not visible to the row
    chunks: int  # P


@dataclass
class AttentionPlan:
    """Index tensors for one forward pass, shared by all layers."""

    num_rows: int
    slots: torch.Tensor  # [T] flat pool slot where each new row's key / value goes
    groups: list[_Group]


def plan_attention(segments: Sequence[tuple[Sequence[int], int, int]], device) -> AttentionPlan:
    """segments: (block_table, start, length) per request, rows consecutive in this order."""
    slots, blocks = [], []  # blocks: (row indices, positions, block table)
    row = 0
    for table, start, length in segments:
        positions = range(start, start + length)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        for b in range(0, length, QUERY_BLOCK):
            n = min(QUERY_BLOCK, length - b)
            blocks.append((list(range(row + b, row + b + n)), [start + b + j for j in range(n)], table))
        row += length
    groups, current, units = [], [], 0
    for blk in blocks:
        need = blk[1][-1] // BLOCK_SIZE + 1
        if current and (len(current) + 1) * max(units, need) > MAX_UNITS:
            groups.append(_make_group(current, row, device))
            current, units = [], 0
        current.append(blk)
        units = max(units, need)
    if current:
        groups.append(_make_group(current, row, device))
    return AttentionPlan(row, torch.tensor(slots, dtype=torch.long, device=device), groups)


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
    T, H, D = q.shape
    KV = k_new.shape[1]
    G = H // KV
    k_pool.index_copy_(0, plan.slots, k_new.to(k_pool.dtype))
    v_pool.index_copy_(0, plan.slots, v_new.to(v_pool.dtype))
    q_rows = torch.cat([q.float() * (1.0 / math.sqrt(D)), q.new_zeros(1, H, D, dtype=torch.float32)])
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=q.device)
    k_blocks = k_pool.view(-1, BLOCK_SIZE, KV, D)
    v_blocks = v_pool.view(-1, BLOCK_SIZE, KV, D)
    for g in plan.groups:
        out.index_copy_(0, g.rows, _attend_group(q_rows, k_blocks, v_blocks, g, KV, G, D))
    return out[:T].to(q.dtype)


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
