"""Linear kernels and their calibration: which way to multiply each weight shape, measured on
the machine that runs.

A kernel is a weight format (`float32`, `bfloat16`, or `int8`: weight-only int8 with one scale
per output channel, computed in bf16 by `torch.ops.aten._weight_int8pack_mm`) with an
operation (`linear`: F.linear; `wxt`: (W @ x^T)^T, which MKL runs as a few-column GEMM that
reads the weights once for up to ~16 rows; `int8mm`) and a row blocking (`None`: one call for
all rows; B: the rows in fixed blocks of B, the last one zero-padded).

Batch invariance: a row's output must not depend on the other rows of the call nor on its
place among them. A GEMM library may pick another kernel or another reduction split for
another row count, so this is a property of the machine, not of the code: `calibrate` checks
it bitwise for every candidate on random weights of the model's own shapes and dtype, and
times the candidates. Invariant mode uses the cheapest candidate that passed; standard mode
the cheapest of all. Results are cached per CPU / torch / shape / threads, because timing the
151,936-row vocabulary head costs seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FORMATS = ("float32", "bfloat16", "int8")
BLOCKS = (None, 1, 4, 8, 16, 32, 64)
# Row counts a pool's calls have: a decode (1), a K+1-row verify, a batch of requests.
PROFILE_ROWS = (1, 5, 16)
CALIBRATION_VERSION = 2


@dataclass(frozen=True)
class Kernel:
    format: str  # float32 / bfloat16 / int8
    op: str  # linear / wxt / int8mm
    block: int | None  # rows per call; None: all rows in one call

    @property
    def name(self) -> str:
        return f"{self.format}:{self.op}" + ("" if self.block is None else f":b{self.block}")

    @classmethod
    def parse(cls, name: str) -> "Kernel":
        parts = name.split(":")
        block = int(parts[2][1:]) if len(parts) > 2 else None
        return cls(parts[0], parts[1], block)


def ops_for(fmt: str) -> tuple[str, ...]:
    return ("int8mm",) if fmt == "int8" else ("linear", "wxt")


def compute_dtype(fmt: str) -> torch.dtype:
    """The dtype activations (and the KV cache) have with weights of this format."""
    return torch.float32 if fmt == "float32" else torch.bfloat16


class Weight:
    """A [out, in] weight matrix in one format, multiplied by its chosen kernel."""

    def __init__(self, w: torch.Tensor, fmt: str, kernel: Kernel | None = None):
        self.format, self.shape = fmt, tuple(w.shape)
        if fmt == "int8":
            w = w.float()
            self.scales = (w.abs().amax(1).clamp_min(1e-12) / 127).to(torch.bfloat16)
            q = torch.round(w / self.scales.float()[:, None]).clamp_(-127, 127)
            self.data = q.to(torch.int8).contiguous()
        else:
            self.data, self.scales = w.to(compute_dtype(fmt)).contiguous(), None
        self.kernel = kernel or Kernel(fmt, ops_for(fmt)[0], None)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = apply(self.kernel, x, self.data, self.scales)
        return out if bias is None else out + bias


def _op(op: str, x, data, scales):
    if op == "linear":
        return F.linear(x, data)
    if op == "wxt":
        return torch.matmul(data, x.T).T
    return torch.ops.aten._weight_int8pack_mm(x, data, scales)


def apply(kernel: Kernel, x: torch.Tensor, data, scales=None) -> torch.Tensor:
    """x [T, in] -> [T, out] with `kernel`; rows in fixed blocks when kernel.block is set."""
    B, T = kernel.block, x.shape[0]
    if B is None:
        return _op(kernel.op, x, data, scales).contiguous()
    pad = -T % B
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == B:
        return _op(kernel.op, x, data, scales)[:T]
    return torch.cat([_op(kernel.op, blk, data, scales) for blk in x.split(B)])[:T]


# ---- calibration -----------------------------------------------------------------------------


@dataclass
class ShapeCalibration:
    shape: tuple[int, int]
    format: str
    ms: dict[str, list[float]]  # kernel name -> ms at PROFILE_ROWS
    invariant: dict[str, bool]  # kernel name -> passed the bitwise check
    fastest: str
    fastest_invariant: str | None

    def cost(self, name: str) -> float:
        return sum(self.ms[name])


def _random_weight(shape, fmt: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = Weight(torch.randn(shape, generator=gen) * 0.02, fmt)
    return w.data, w.scales


def is_invariant(kernel: Kernel, data, scales, max_rows: int, gen: torch.Generator) -> bool:
    """Bitwise: each row's output equals the same row computed alone, at every place of a
    call and for the row counts a GEMM library treats differently. A blocked kernel's calls
    always have `block` rows, so its check is one full block against rows alone."""
    rows = kernel.block or max_rows
    x = torch.randn(rows, data.shape[1], generator=gen).to(compute_dtype(kernel.format))
    alone: dict[int, torch.Tensor] = {}

    def row_alone(i: int) -> torch.Tensor:
        if i not in alone:
            alone[i] = apply(kernel, x[i : i + 1], data, scales)[0]
        return alone[i]

    if kernel.block is not None:
        out = apply(kernel, x, data, scales)
        return all(torch.equal(out[i], row_alone(i)) for i in sorted({0, 1 % rows, rows // 2, rows - 1}))
    counts = [n for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 48, 64) if n <= rows]
    for n in counts:
        for start in sorted({0, rows - n}):
            out = apply(kernel, x[start : start + n], data, scales)
            if not all(torch.equal(out[i], row_alone(start + i)) for i in (0, n // 2, n - 1)):
                return False
    return True


def time_op(fmt: str, op: str, data, scales, rows: int, min_s: float = 0.03) -> float:
    """ms of one unblocked call with `rows` rows: the fastest of at least 5, since other
    work on the machine (the other pool calibrating) only ever adds time."""
    kernel = Kernel(fmt, op, None)
    x = torch.randn(rows, data.shape[1]).to(compute_dtype(fmt))
    apply(kernel, x, data, scales)  # warm-up
    times, spent = [], 0.0
    while len(times) < 5 or spent < min_s:
        start = time.perf_counter()
        apply(kernel, x, data, scales)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times) * 1e3


def calibrate_shape(shape: tuple[int, int], fmt: str, *, check_rows: int = 32) -> ShapeCalibration:
    """Times each operation once per row count it is ever called with; a blocked kernel at
    r rows costs ceil(r / B) calls of B rows."""
    gen = torch.Generator().manual_seed(0)
    data, scales = _random_weight(shape, fmt, gen)
    ms, inv = {}, {}
    for op in ops_for(fmt):
        needed = sorted({*PROFILE_ROWS, *(b for b in BLOCKS if b)})
        base = {r: time_op(fmt, op, data, scales, r) for r in needed}
        for b in BLOCKS:
            k = Kernel(fmt, op, b)
            ms[k.name] = [base[r] if b is None else -(-r // b) * base[b] for r in PROFILE_ROWS]
            inv[k.name] = is_invariant(k, data, scales, check_rows, gen)
    fastest = min(ms, key=lambda n: sum(ms[n]))
    passing = [n for n in ms if inv[n]]
    best_inv = min(passing, key=lambda n: sum(ms[n])) if passing else None
    return ShapeCalibration(tuple(shape), fmt, ms, inv, fastest, best_inv)


def machine_key() -> str:
    """What a calibration depends on besides the shape: CPU model and flags, torch, threads."""
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text()
        names = [line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith(("model name", "flags"))]
        cpu = " ".join(names[:2])
    except OSError:
        pass
    raw = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}|{CALIBRATION_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    root = os.environ.get("SPECDEC_CACHE") or os.path.expanduser("~/.cache/specdec")
    return Path(root) / "calibration" / f"{machine_key()}.json"


def calibrate(shapes: Sequence[tuple[int, int]], fmt: str, *, use_cache: bool = True,
              check_rows: int = 32) -> dict[tuple[int, int], ShapeCalibration]:
    """Calibrations for every distinct shape, from the machine's cache where present."""
    path = _cache_file()
    cache = {}
    if use_cache and path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    out, changed = {}, False
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        key = f"{fmt}:{shape[0]}x{shape[1]}:{check_rows}"
        if key in cache:
            c = cache[key]
            out[shape] = ShapeCalibration(tuple(c["shape"]), c["format"], c["ms"], c["invariant"],
                                          c["fastest"], c["fastest_invariant"])
            continue
        started = time.perf_counter()
        out[shape] = calibrate_shape(shape, fmt, check_rows=check_rows)
        logger.info("calibrated %s %s in %.1f s: fastest %s, fastest invariant %s", fmt, shape,
                    time.perf_counter() - started, out[shape].fastest, out[shape].fastest_invariant)
        cache[key] = asdict(out[shape])
        changed = True
    if changed and use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as e:  # a read-only home: calibrate again next time
            logger.warning("could not cache the kernel calibration in %s: %s", path, e)
    return out


def forward_ms(cal: dict[tuple[int, int], ShapeCalibration], counts: dict[tuple[int, int], int],
               invariant: bool) -> list[float] | None:
    """Estimated ms of the model's matmuls at PROFILE_ROWS with the chosen kernels (None when
    a shape has no invariant kernel and invariance is asked for)."""
    total = [0.0] * len(PROFILE_ROWS)
    for shape, n in counts.items():
        c = cal[shape]
        name = c.fastest_invariant if invariant else c.fastest
        if name is None:
            return None
        total = [t + n * m for t, m in zip(total, c.ms[name])]
    return total
