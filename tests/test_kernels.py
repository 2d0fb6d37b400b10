"""Kernel candidates and their calibration (specdec.kernels): padded calls for GEMM libraries
that tile rows and sum a remainder tile differently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import kernels
from specdec.kernels import Kernel, Weight, good_row_counts, is_invariant, padded_calls

ROOT = Path(__file__).resolve().parent.parent


def tiled_gemm(name, x, data, scales):
    """What FBGEMM's fp16 GEMM does on AVX2: rows in tiles of 6, a tile of 1 or 2 rows
    summed in another order than the others (here: two halves of K added last)."""
    outs = []
    for tile in x.split(6):
        if tile.shape[0] <= 2:
            h = data.shape[1] // 2
            outs.append(tile[:, :h] @ data[:, :h].T + tile[:, h:] @ data[:, h:].T)
        else:
            outs.append(torch.stack([data @ row for row in tile]))
    return torch.cat(outs)


def test_padded_calls():
    good = (3, 4, 5, 6, 8, 9)
    assert padded_calls(1, good) == [3]
    assert padded_calls(7, good) == [8]
    assert padded_calls(9, good) == [9]
    assert padded_calls(10, good) == [9, 3]
    assert padded_calls(20, good) == [9, 9, 3]


def test_tiled_gemm_finds_its_good_row_counts_and_pads_to_them(monkeypatch):
    monkeypatch.setattr(kernels, "_op", tiled_gemm)
    gen = torch.Generator().manual_seed(0)
    w = Weight(torch.randn(64, 96, generator=gen), "float32")
    good = good_row_counts("linear", w, gen, max_rows=24)
    # a count is good when no tile has 1 or 2 rows: remainders 0, 3, 4, 5 of 6
    assert good == [m for m in range(3, 25) if m % 6 not in (1, 2)]
    padded = Kernel("float32", "linear", None, tuple(good))
    assert is_invariant(padded, w, 32, gen)
    assert not is_invariant(Kernel("float32", "linear", None), w, 32, gen)
    cal = kernels.calibrate_shape((64, 96), "float32")
    assert cal.invariant["float32:linear:pad"] and not cal.invariant["float32:linear"]
    assert cal.kernel("float32:linear:pad").pad_to == tuple(good)


@pytest.mark.skipif("float16" not in kernels.FORMATS, reason="FBGEMM (x86 builds) only")
def test_fbgemm_fp16_padded_kernel_is_invariant():
    gen = torch.Generator().manual_seed(1)
    w = Weight(torch.randn(256, 512, generator=gen) * 0.02, "float16")
    good = good_row_counts("fbgemm", w, gen)
    assert good, "no row count gave consistent rows"
    assert is_invariant(Kernel("float16", "fbgemm", None, tuple(good)), w, 32, gen)
    x = torch.randn(5, 512, generator=gen)
    ref = torch.nn.functional.linear(x, torch.ops.quantized.linear_unpack_fp16(w.data)[0])
    torch.testing.assert_close(w(x), ref, atol=1e-5, rtol=1e-4)


def test_calibration_times_rows_beyond_the_choice_profile_for_the_k_policy():
    """Kernels are chosen over PROFILE_ROWS, but times are listed at COST_ROWS too, so the
    K policy sees what a batch of verifies (several 16-row blocks) costs."""
    assert kernels.COST_ROWS[: len(kernels.PROFILE_ROWS)] == kernels.PROFILE_ROWS
    assert max(kernels.COST_ROWS) >= 8 * 7  # eight requests' verifies at K = 6
    cal = kernels.calibrate_shape((64, 96), "float32")
    assert all(len(ms) == len(kernels.COST_ROWS) for ms in cal.ms.values())
    b16 = cal.ms["float32:linear:b16"]
    one_block = b16[kernels.PROFILE_ROWS.index(16)]
    assert b16[-1] == pytest.approx(-(-max(kernels.COST_ROWS) // 16) * one_block)
    # both sides of each step are listed: the K policy interpolates between listed rows
    for rows, blocks in ((16, 1), (17, 2), (32, 2), (33, 3)):
        assert b16[kernels.COST_ROWS.index(rows)] == pytest.approx(blocks * one_block)
    assert cal.cost(cal.fastest) == kernels.profile_sum(cal.ms[cal.fastest])


@pytest.mark.parametrize("fmt", kernels.FORMATS)
def test_timing_streams_copies_of_the_weight_that_do_not_fit_the_cache(monkeypatch, fmt):
    """A forward pass reads each matrix from memory; timing one matrix in a loop would read
    it from the last-level cache. The copies are distinct memory, hold the same matrix,
    together exceed twice the cache, and the timing loop reads each of them in turn."""
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(64, 96, generator=gen) * 0.02
    weight = Weight(source, fmt)
    llc = 40 * weight.nbytes
    copies = kernels.streamed_copies(weight, source, llc_bytes=llc)
    assert sum(c.nbytes for c in copies) >= 2 * llc
    x = torch.randn(3, 96).to(kernels.compute_dtype(fmt))
    for c in copies[1:]:
        assert torch.equal(c(x), weight(x))
    if fmt not in kernels.FBGEMM_FORMATS:  # FBGEMM's packings are opaque
        assert len({c.data.data_ptr() for c in copies}) == len(copies)

    seen = []
    real_op = kernels._op
    monkeypatch.setattr(kernels, "_op", lambda op, x, data, scales: (seen.append(id(data)),
                                                                     real_op(op, x, data, scales))[1])
    kernels.time_op(kernels.ops_for(fmt)[0], copies, rows=2, min_s=0.0)
    assert {id(c.data) for c in copies} <= set(seen[1:])  # every copy timed, after the warm-up
    assert kernels.last_level_cache_bytes() > 0


def test_replicas_loading_together_calibrate_once_and_agree(monkeypatch, tmp_path):
    """Two replicas of a pool on one machine must use the same kernels (a request failing
    over between them keeps its bits); calibrating both at once would time twice and could
    choose differently. The second waits for the first's cached result."""
    import threading
    import time as _time

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    runs = []
    real = kernels.calibrate_shape

    def slow_calibration(shape, fmt, *, check_rows=32):
        runs.append(shape)
        _time.sleep(0.3)  # both loaders are inside calibrate() at once
        return real(shape, fmt, check_rows=check_rows)

    monkeypatch.setattr(kernels, "calibrate_shape", slow_calibration)
    results = [None, None]

    def load(i):
        results[i] = kernels.calibrate([(32, 48)], "float32")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert runs == [(32, 48)]
    assert results[0] == results[1]


@pytest.mark.skipif("w8a8" not in kernels.FORMATS, reason="FBGEMM (x86 builds) only")
def test_w8a8_quantizes_each_row_alone_so_rows_do_not_depend_on_their_neighbours():
    """FBGEMM's int8 GEMM quantizes a call's activations with one scale: called directly,
    a row's bits change when a row of larger magnitude joins it. Through the w8a8 kernel
    (each row on its own scale) they do not, at any row count, and stay close to fp32."""
    gen = torch.Generator().manual_seed(2)
    source = torch.randn(320, 256, generator=gen) * 0.02
    w = Weight(source, "w8a8")
    x = torch.randn(40, 256, generator=gen) * torch.rand(40, 1, generator=gen) * 4
    rows = torch.ops.quantized.linear_dynamic  # the call's range, not the row's, sets the scale
    plain = kernels._prepack_w8a8(source)
    alone = rows(torch.cat([x[:1], torch.tensor([[1.0, -1.0]])], 1), plain, True)
    joined = rows(torch.cat([x[:2] * torch.tensor([[1.0], [50.0]]), torch.tensor([[1.0, -1.0]] * 2)], 1), plain, True)
    assert not torch.equal(alone[0], joined[0])
    assert is_invariant(w.kernel, w, 48, gen)
    ref = x @ source.T
    assert ((w(x) - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.skipif("w8a8" not in kernels.FORMATS, reason="FBGEMM (x86 builds) only")
def test_dtype_auto_offers_activation_quantizing_formats_to_drafts_only(monkeypatch):
    """A draft's numbers change acceptance only; a target's are the distribution served."""
    from specdec import runner

    assert "w8a8" in runner.auto_formats(draft=True)
    assert "w8a8" not in runner.auto_formats(draft=False)
    fast = {"w8a8": [1.0] * len(kernels.COST_ROWS)}
    monkeypatch.setattr(kernels, "calibrate", lambda shapes, fmt: fmt)
    monkeypatch.setattr(kernels, "forward_ms", lambda fmt, shapes, inv: fast.get(fmt, [9.0] * len(kernels.COST_ROWS)))
    shapes = {(64, 96): 1}
    assert runner.choose_format(shapes, "cpu", True, draft=True)[0] == "w8a8"
    assert runner.choose_format(shapes, "cpu", True)[0] != "w8a8"


AVX512_CPU = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_tile\n"


def test_instruction_set_caps_key_the_calibration_and_the_flags_kernels_may_use(monkeypatch):
    """Under the libraries' AVX2 caps (benchmarks/avx2_cap.env) an AVX-512 machine runs its
    kernels as an AVX2-only CPU: its calibration must not be the uncapped one's, FBGEMM's
    int8 GEMM has no VNNI (so w8a8 keeps 7-bit activations), and the compiled attention is
    built without AVX-512."""
    from cluster.node_env import read_env_file
    from specdec import native

    monkeypatch.setattr(kernels, "_cpuinfo_text", lambda: AVX512_CPU)
    for name in kernels.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    uncapped = kernels.machine_key()
    assert "avx512f" in kernels.cpu_flags() and kernels._fbgemm_has_vnni()
    assert all("-mno-avx512f" not in f for f in native.build_flags())

    cap = read_env_file(ROOT / "benchmarks" / "avx2_cap.env")
    assert set(cap) == set(kernels.ISA_CAPS)
    for name, value in cap.items():
        monkeypatch.setenv(name, value)
    assert kernels.machine_key() != uncapped
    assert kernels.isa_caps() == cap
    flags = kernels.cpu_flags()
    assert "avx2" in flags and not [f for f in flags if f.startswith(("avx512", "amx"))]
    assert not kernels._fbgemm_has_vnni()
    assert "-mno-avx512f" in native.build_flags()[0]
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512_E1")  # FBGEMM's VNNI level
    assert kernels._fbgemm_has_vnni()
