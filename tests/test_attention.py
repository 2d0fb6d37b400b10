"""The paged attention's key-block sum: a row's bits must not depend on how many key blocks
the longest request of its call has (those past the row's own end are exact zeros)."""

from __future__ import annotations

import torch

from specdec.attention import _sum_key_blocks


def test_key_block_sum_is_the_same_bits_whatever_the_padding():
    gen = torch.Generator().manual_seed(0)
    for own in (1, 2, 3, 5, 8, 13):
        o = torch.randn(3, own, 2, 4, 9, generator=gen) * torch.logspace(-3, 3, 9)  # wide range
        alone = _sum_key_blocks(o)
        torch.testing.assert_close(alone, o.double().sum(1).float(), atol=1e-4, rtol=1e-5)
        for longest in range(own + 1, 40):
            padded = torch.cat([o, o.new_zeros(3, longest - own, 2, 4, 9)], 1)
            assert torch.equal(_sum_key_blocks(padded), alone), (own, longest)
