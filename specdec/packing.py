"""Exact, compact transport of probability rows between deployments.

A row over a 151,936-token vocabulary is 0.6 MB in float32. Most requests' processed
distributions are sparse (greedy rows are one-hot; top-k / top-p leave a few tokens), so a
block of rows travels as (indices, values) of its nonzero entries when that is smaller,
and dense otherwise. Values are the same float32 numbers either way: the rejection sampler
sees exactly the distribution the sender computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedProbs:
    shape: tuple[int, int]
    dense: np.ndarray | None = None  # [R, V] float32
    indices: np.ndarray | None = None  # [R, m] int32, m = the largest support of a row
    values: np.ndarray | None = None  # [R, m] float32 (zeros pad rows with smaller support)


def pack_probs(probs: torch.Tensor) -> PackedProbs:
    """Pack [R, V] probabilities, sparse when the widest row's support is under V / 4."""
    probs = probs.detach().to("cpu", torch.float32)
    rows, vocab = probs.shape
    support = int(torch.count_nonzero(probs, dim=1).max()) if rows else 0
    if support * 4 >= vocab:
        return PackedProbs(shape=(rows, vocab), dense=probs.numpy())
    values, indices = probs.topk(max(support, 1), dim=1)
    return PackedProbs(
        shape=(rows, vocab),
        indices=indices.to(torch.int32).numpy(),
        values=values.numpy(),
    )


def pack_blocks(probs: torch.Tensor, lengths: Sequence[int]) -> list[PackedProbs]:
    """`pack_probs` of each block of consecutive rows (block i holds lengths[i] rows), with
    one pass over all of them instead of one per block. Each block unpacks to exactly what
    `pack_probs` of that block unpacks to, and is dense or sparse by the same rule (sparse
    indices may differ only among equal values and in the zero padding)."""
    probs = probs.detach().to("cpu", torch.float32)
    vocab = probs.shape[1]
    lens = [int(n) for n in lengths]
    n = len(lens)
    if not n:
        return []
    block = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
    row_support = torch.count_nonzero(probs, dim=1)  # probabilities are >= 0
    support = torch.zeros(n, dtype=torch.long).scatter_reduce_(0, block, row_support, "amax")
    support_list = support.tolist()
    dense = [m * 4 >= vocab for m in support_list]
    out: list[PackedProbs] = []
    arr = probs.numpy()
    sparse = [i for i in range(n) if not dense[i]]
    if sparse:
        rows = ~torch.tensor(dense)[block]
        width = max(max(support_list[i] for i in sparse), 1)
        values, indices = probs[rows].topk(width, dim=1)
        values, indices = values.numpy(), indices.to(torch.int32).numpy()
    start = sparse_start = 0
    for i, (r, m) in enumerate(zip(lens, support_list)):
        if dense[i]:
            out.append(PackedProbs(shape=(r, vocab), dense=arr[start : start + r]))
        else:
            m, stop = max(m, 1), sparse_start + r
            out.append(PackedProbs(
                shape=(r, vocab),
                indices=np.ascontiguousarray(indices[sparse_start:stop, :m]),
                values=np.ascontiguousarray(values[sparse_start:stop, :m]),
            ))
            sparse_start = stop
        start += r
    return out


def unpack_probs(packed: PackedProbs, device: str | torch.device = "cpu") -> torch.Tensor:
    """The dense [R, V] float32 tensor that was packed."""
    if packed.dense is not None:
        return torch.from_numpy(np.array(packed.dense, copy=True)).to(device)
    out = torch.zeros(packed.shape, dtype=torch.float32)
    out.scatter_(1, torch.from_numpy(packed.indices).long(), torch.from_numpy(packed.values))
    return out.to(device)
