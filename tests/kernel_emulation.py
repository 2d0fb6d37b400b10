"""A batch-variant matmul for tests: what a GPU GEMM's split-K heuristic does, on CPU."""

from __future__ import annotations

import torch


def split_k(op):
    """Wraps specdec.kernels._op: 4 K-splits under 4 rows, 2 up to 16, 1 above, each split's
    partial sum rounded to bf16 before they are added, so a row's numbers depend on how many
    rows share the call (the int8 and fp16 FBGEMM kernels are left alone)."""

    def split_op(name, x, data, scales):
        m, k = x.shape[0], x.shape[-1]
        splits = 4 if m < 4 else 2 if m <= 16 else 1
        if splits == 1 or k % splits or name in ("int8mm", "fbgemm"):
            return op(name, x, data, scales)
        parts = [op(name, xs, ws.contiguous(), scales).to(torch.bfloat16).float()
                 for xs, ws in zip(x.chunk(splits, -1), data.chunk(splits, -1))]
        return sum(parts).to(x.dtype)

    return split_op
