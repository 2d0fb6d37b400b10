"""Linear kernels and their calibration: which way to multiply each weight shape, measured on
the machine that runs.

A kernel is a weight format with an operation and a row blocking (`None`: one call for all
rows; B: the rows in fixed blocks of B, the last one zero-padded). Formats:
- `float32`, `bfloat16`: ops `linear` (F.linear) and `wxt` ((W @ x^T)^T, which MKL runs as a
  few-column GEMM that reads the weights once for up to ~16 rows);
- `int8`: weight-only int8, one scale per output channel, computed in bf16 by
  `torch.ops.aten._weight_int8pack_mm` (op `int8mm`);
- `float16`: fp16 weights prepacked for FBGEMM's fp16 GEMM, fp32 activations and accumulation
  (`torch.ops.quantized.linear_dynamic_fp16`, op `fbgemm`; x86 builds only). Made for few-row
  inference on CPUs without bf16 instructions: it reads half the bytes of fp32 and stays
  memory-bound (flat in rows) up to a K+1-row verify, where `int8mm` and fp32 are not.
- `w8a8`: int8 weights (one scale per output channel) and int8 activations, int32 sums,
  through FBGEMM's int8 GEMM (`torch.ops.quantized.linear_dynamic`, op `fbgemm8`; x86 builds
  only). It reads a quarter of fp32's bytes and is the cheapest few-row kernel on CPUs whose
  torch bf16 GEMM is slow, but quantizing the activations changes the model's numbers more
  than the weight-only formats: `dtype: auto` offers it to a draft only (a draft's numbers
  change acceptance, never the text's distribution). FBGEMM quantizes a call's activations
  with one scale for the whole call, which would tie a row's bits to its neighbours; so each
  row is first divided by its own largest magnitude and two columns holding +1 and -1 (with
  zero weights) are appended: every call's range is then exactly [-1, 1], its scale a
  constant, each row quantized alone, and the integer sums exact in any order.

Batch invariance: a row's output must not depend on the other rows of the call nor on its
place among them. A GEMM library may pick another kernel or another reduction split for
another row count, so this is a property of the machine, not of the code: `calibrate` checks
it bitwise for every candidate on random weights of the model's own shapes and dtype, and
times the candidates. Invariant mode uses the cheapest candidate that passed; standard mode
the cheapest of all. Results are cached per CPU / torch / shape / threads, because timing the
151,936-row vocabulary head costs seconds.

Timing streams the weights from memory, as a forward pass does: each call reads another copy
of the matrix, and the copies together are twice the last-level cache. Timed in a loop on
one copy, a matrix that fits the cache (all but the largest on a CPU with a 260 MiB L3) is
read at cache speed, and the calibration would call a decode half as costly as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ALL_FORMATS = ("float32", "bfloat16", "int8", "float16", "w8a8")
FBGEMM_FORMATS = ("float16", "w8a8")  # x86 builds of torch have FBGEMM, others do not
FORMATS = tuple(f for f in ALL_FORMATS
                if f not in FBGEMM_FORMATS or "fbgemm" in torch.backends.quantized.supported_engines)
# Formats that change a model's activations, not only its weights: for drafts only, unless
# a user names one for a target.
DRAFT_ONLY_FORMATS = ("w8a8",)
BLOCKS = (None, 1, 4, 8, 16, 32, 64)
# Row counts a pool's calls have: a decode (1), a K+1-row verify, a batch of requests.
# Kernels and formats are chosen by their total time over these.
PROFILE_ROWS = (1, 5, 16)
# Timed too, for the K policy's cost table: eight requests' verifies fill several 16-row
# blocks, and a table that stopped at 16 rows would call their extra blocks free. Both sides
# of the 16- and 32-row boundaries are listed, so that the policy's linear interpolation
# sees a blocked kernel's step (a 17-row pass costs two 16-row blocks, not 1/16 more): with
# only 16 and 64 listed, eight requests at K=2 (24 rows) looked a third cheaper than they ran.
COST_ROWS = PROFILE_ROWS + (8, 17, 32, 33, 64)
# Row counts searched for a padded kernel's invariant counts; longer inputs are cut.
PAD_SEARCH_ROWS = 24
CALIBRATION_VERSION = 7  # 7: costs listed on both sides of 16- and 32-row blocks
# Where sysfs does not say how large the last-level cache is.
DEFAULT_LLC_BYTES = 64 << 20
MAX_COPIES = 512  # tiny matrices (tests) stay cached whatever we do; bound the copies


@dataclass(frozen=True)
class Kernel:
    format: str  # one of FORMATS
    op: str  # linear / wxt / int8mm / fbgemm
    block: int | None  # rows per call; None: all rows in one call
    # Padding instead of blocks: every call is zero-padded up to the next of these row counts
    # (measured to give each row the same bits), longer inputs are cut into calls of the
    # largest one. Empty: no padding.
    pad_to: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        if self.pad_to:
            return f"{self.format}:{self.op}:pad"
        return f"{self.format}:{self.op}" + ("" if self.block is None else f":b{self.block}")

    @classmethod
    def parse(cls, name: str, pad_to: Sequence[int] = ()) -> "Kernel":
        parts = name.split(":")
        if len(parts) > 2 and parts[2] == "pad":
            return cls(parts[0], parts[1], None, tuple(pad_to))
        block = int(parts[2][1:]) if len(parts) > 2 else None
        return cls(parts[0], parts[1], block)


def ops_for(fmt: str) -> tuple[str, ...]:
    return {"int8": ("int8mm",), "float16": ("fbgemm",), "w8a8": ("fbgemm8",)}.get(fmt, ("linear", "wxt"))


def compute_dtype(fmt: str) -> torch.dtype:
    """The dtype activations (and the KV cache) have with weights of this format."""
    return torch.float32 if fmt in ("float32", "float16", "w8a8") else torch.bfloat16


class Weight:
    """A [out, in] weight matrix in one format, multiplied by its chosen kernel."""

    def __init__(self, w: torch.Tensor, fmt: str, kernel: Kernel | None = None):
        self.format, self.shape = fmt, tuple(w.shape)
        self.scales = None
        if fmt == "float16":  # an opaque FBGEMM packing of the fp16 weights
            if w.device.type != "cpu":
                raise ValueError("float16 weights use FBGEMM, a CPU library: use bfloat16 on GPUs")
            self.data = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)
        elif fmt == "w8a8":
            if w.device.type != "cpu":
                raise ValueError("w8a8 weights use FBGEMM, a CPU library: use bfloat16 on GPUs")
            self.data = _prepack_w8a8(w.float())
        elif fmt == "int8":
            w = w.float()
            self.scales = (w.abs().amax(1).clamp_min(1e-12) / 127).to(torch.bfloat16)
            q = torch.round(w / self.scales.float()[:, None]).clamp_(-127, 127)
            self.data = q.to(torch.int8).contiguous()
        else:
            self.data = w.to(compute_dtype(fmt)).contiguous()
        self.kernel = kernel or Kernel(fmt, ops_for(fmt)[0], None)

    @property
    def nbytes(self) -> int:
        if self.format in FBGEMM_FORMATS:  # opaque packings: 2 or 1 bytes per weight
            return self.shape[0] * self.shape[1] * (2 if self.format == "float16" else 1)
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
    if op == "fbgemm":
        return torch.ops.quantized.linear_dynamic_fp16(x, data)
    if op == "fbgemm8":
        return _w8a8(x, data)
    return torch.ops.aten._weight_int8pack_mm(x, data, scales)


# Appended to every w8a8 input row: fixes each call's activation range to [-1, 1].
_RANGE_COLUMNS = torch.tensor([[1.0, -1.0]])


@functools.lru_cache(maxsize=1)
def _cpuinfo_text() -> str:
    try:  # read once per process: the CPU does not change, and many-core files are large
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo(field: str) -> str:
    """The first CPU's `field` line of /proc/cpuinfo ('' where there is none)."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo_text().splitlines()
                 if line.startswith(field)), "")


# Each library's own switch that caps the instruction sets it runs: ATen's vectorized
# kernels, oneDNN (bf16 GEMMs), FBGEMM (fp16 and int8 GEMMs), MKL (fp32 GEMMs). All four set
# to AVX2 (benchmarks/avx2_cap.env) make an AVX-512 machine run its kernels as an AVX2-only CPU
# would, so that the calibration can be exercised for that class where none is at hand.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS",
            "MKL_ENABLE_INSTRUCTIONS")


def isa_caps() -> dict[str, str]:
    """The instruction-set caps set in this process's environment."""
    return {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}


def cpu_flags() -> list[str]:
    """The CPU's flags as this process's kernels may use them: under ATen's AVX2 cap (the
    switch our own compiled kernel follows too) without the AVX-512 and AMX ones."""
    flags = cpuinfo("flags").split()
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        flags = [f for f in flags if not f.startswith(("avx512", "amx"))]
    return flags


def _fbgemm_has_vnni() -> bool:
    """Whether FBGEMM runs its VNNI kernels: the CPU has them and no cap below them is set
    (FBGEMM's AVX512_E1 names are its VNNI levels)."""
    cap = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    return "avx512_vnni" in cpuinfo("flags").split() and (not cap or cap.startswith("AVX512_E1"))


# Without VNNI FBGEMM adds pairs of u8 x s8 products in int16, which 8-bit activations can
# overflow; 7 bits cannot (PyTorch's reduce_range).
_W8A8_REDUCE_RANGE = not _fbgemm_has_vnni()


def _prepack_w8a8(w: torch.Tensor):
    scales = w.abs().amax(1).clamp_min(1e-12) / 127
    padded = torch.cat([w, w.new_zeros(w.shape[0], _RANGE_COLUMNS.shape[1])], 1)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors (kept: pinned)
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(padded, scales.double(), zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def _w8a8(x: torch.Tensor, packed) -> torch.Tensor:
    """x [T, in] float32 through FBGEMM's int8 GEMM, each row quantized on its own scale."""
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
    rows = torch.cat([x / scale, _RANGE_COLUMNS.expand(x.shape[0], -1)], 1)
    return torch.ops.quantized.linear_dynamic(rows, packed, _W8A8_REDUCE_RANGE) * scale


def apply(kernel: Kernel, x: torch.Tensor, data, scales=None) -> torch.Tensor:
    """x [T, in] -> [T, out] with `kernel`; rows in fixed blocks when kernel.block is set,
    in calls padded to a measured row count when kernel.pad_to is. Input and output are
    contiguous whatever the op returns: a GEMM library may take another path for a strided
    operand, so a layout that depends on the row count (`wxt`'s transposed result in a
    one-block call, a cat in a longer one) would make the next matmul batch-variant."""
    x = x.contiguous()
    if kernel.pad_to:
        return _apply_padded(kernel, x, data, scales)
    B, T = kernel.block, x.shape[0]
    if B is None:
        return _op(kernel.op, x, data, scales).contiguous()
    pad = -T % B
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == B:
        return _op(kernel.op, x, data, scales)[:T].contiguous()
    return torch.cat([_op(kernel.op, blk, data, scales) for blk in x.split(B)])[:T]


def padded_calls(rows: int, pad_to: Sequence[int]) -> list[int]:
    """The row count of each call a padded kernel makes for `rows` rows."""
    top, calls = pad_to[-1], []
    for start in range(0, rows, top):
        n = min(top, rows - start)
        calls.append(next(m for m in pad_to if m >= n))
    return calls


def _apply_padded(kernel: Kernel, x: torch.Tensor, data, scales) -> torch.Tensor:
    outs = []
    for start, size in zip(range(0, x.shape[0], kernel.pad_to[-1]), padded_calls(x.shape[0], kernel.pad_to)):
        blk = x[start : start + kernel.pad_to[-1]]
        n = blk.shape[0]
        if size > n:
            blk = torch.cat([blk, blk.new_zeros(size - n, blk.shape[1])])
        outs.append(_op(kernel.op, blk, data, scales)[:n])
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


# ---- calibration -----------------------------------------------------------------------------


def profile_sum(ms_at_cost_rows: Sequence[float]) -> float:
    """What choices weigh: the total over PROFILE_ROWS of times listed at COST_ROWS."""
    return sum(ms_at_cost_rows[: len(PROFILE_ROWS)])


@dataclass
class ShapeCalibration:
    shape: tuple[int, int]
    format: str
    ms: dict[str, list[float]]  # kernel name -> ms at COST_ROWS
    invariant: dict[str, bool]  # kernel name -> passed the bitwise check
    fastest: str
    fastest_invariant: str | None
    pad_to: dict[str, list[int]] = field(default_factory=dict)  # op -> row counts of its pad kernel

    def cost(self, name: str) -> float:
        return profile_sum(self.ms[name])

    def kernel(self, name: str) -> Kernel:
        return Kernel.parse(name, self.pad_to.get(name.split(":")[1], ()))


def is_invariant(kernel: Kernel, weight: Weight, max_rows: int, gen: torch.Generator) -> bool:
    """Bitwise: each row's output equals the same row computed alone, at every place of a
    call and for the row counts a GEMM library treats differently. A blocked kernel's calls
    always have `block` rows, so its check is one full block against rows alone."""
    rows = kernel.block or (max_rows + max(kernel.pad_to, default=0))
    data, scales = weight.data, weight.scales
    x = torch.randn(rows, weight.shape[1], generator=gen).to(compute_dtype(kernel.format))
    alone: dict[int, torch.Tensor] = {}

    def row_alone(i: int) -> torch.Tensor:
        if i not in alone:
            alone[i] = apply(kernel, x[i : i + 1], data, scales)[0]
        return alone[i]

    if kernel.block is not None:
        out = apply(kernel, x, data, scales)
        same = apply(kernel, x[:1].expand(rows, -1), data, scales)  # one row at every place
        return (all(torch.equal(same[i], same[0]) for i in range(rows))
                and all(torch.equal(out[i], row_alone(i)) for i in sorted({0, 1 % rows, rows // 2, rows - 1})))
    counts = [n for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 48, 64) if n <= rows]
    for n in counts:
        for start in sorted({0, rows - n}):
            out = apply(kernel, x[start : start + n], data, scales)
            if not all(torch.equal(out[i], row_alone(start + i)) for i in (0, n // 2, n - 1)):
                return False
    return True


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists (the shared L3 on x86), or DEFAULT_LLC_BYTES."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=DEFAULT_LLC_BYTES)


def streamed_copies(weight: Weight, source: torch.Tensor, llc_bytes: int | None = None) -> list[Weight]:
    """`weight` and enough copies of it (made from `source`, its float matrix) that reading
    them in turn never finds one in the last-level cache: together twice its size."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    n = min(MAX_COPIES, -(-2 * llc // max(weight.nbytes, 1)))
    return [weight] + [Weight(source.clone(), weight.format) for _ in range(n - 1)]


def time_op(op: str, weights: Sequence[Weight], rows: int, min_s: float = 0.03) -> float:
    """ms of one unblocked call with `rows` rows, each call on the next of `weights` (copies
    of one matrix, streamed_copies): the fastest of at least 5 and of one pass over the
    copies, since other work on the machine (the other pool calibrating) only adds time."""
    fmt = weights[0].format
    kernel = Kernel(fmt, op, None)
    x = torch.randn(rows, weights[0].shape[1]).to(compute_dtype(fmt))
    apply(kernel, x, weights[-1].data, weights[-1].scales)  # warm-up (the code, not the data)
    times, spent = [], 0.0
    while len(times) < max(5, len(weights)) or spent < min_s:
        w = weights[len(times) % len(weights)]
        start = time.perf_counter()
        apply(kernel, x, w.data, w.scales)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times) * 1e3


def good_row_counts(op: str, weight: Weight, gen: torch.Generator, max_rows: int = PAD_SEARCH_ROWS) -> list[int]:
    """The row counts at which one call gives every row the same bits: the largest set of
    counts whose outputs agree row by row with one reference count's (GEMM libraries tile
    rows, and a row in a remainder tile may be summed differently)."""
    x = torch.randn(max_rows, weight.shape[1], generator=gen).to(compute_dtype(weight.format))
    native = Kernel(weight.format, op, None)
    outs = {m: apply(native, x[:m], weight.data, weight.scales) for m in range(1, max_rows + 1)}
    best: list[int] = []
    for ref in range(max_rows, 0, -1):
        agree = [m for m in range(1, ref + 1) if torch.equal(outs[m], outs[ref][:m])]
        if len(agree) > len(best):
            best = agree
    return best


def calibrate_shape(shape: tuple[int, int], fmt: str, *, check_rows: int = 32) -> ShapeCalibration:
    """Times each operation once per row count it is ever called with; a blocked kernel at
    r rows costs ceil(r / B) calls of B rows, a padded one its padded calls."""
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(shape, generator=gen) * 0.02
    weight = Weight(source, fmt)
    copies = streamed_copies(weight, source)
    ms, inv, pads = {}, {}, {}
    for op in ops_for(fmt):
        pad_to = pads[op] = good_row_counts(op, weight, gen)
        candidates = [Kernel(fmt, op, b) for b in BLOCKS] + [Kernel(fmt, op, None, tuple(pad_to))]
        needed = {*COST_ROWS, *(b for b in BLOCKS if b)}
        needed |= {m for r in COST_ROWS for m in padded_calls(r, pad_to)}
        base = {r: time_op(op, copies, r) for r in sorted(needed)}
        for k in candidates:
            if k.pad_to:
                ms[k.name] = [sum(base[m] for m in padded_calls(r, k.pad_to)) for r in COST_ROWS]
            else:
                ms[k.name] = [base[r] if k.block is None else -(-r // k.block) * base[k.block]
                              for r in COST_ROWS]
            inv[k.name] = is_invariant(k, weight, check_rows, gen)
    fastest = min(ms, key=lambda n: profile_sum(ms[n]))
    passing = [n for n in ms if inv[n]]
    best_inv = min(passing, key=lambda n: profile_sum(ms[n])) if passing else None
    return ShapeCalibration(tuple(shape), fmt, ms, inv, fastest, best_inv, pads)


def machine_key() -> str:
    """What a calibration depends on besides the shape: CPU model and flags, the libraries'
    instruction-set caps, torch, threads."""
    cpu = f'{cpuinfo("model name")} {cpuinfo("flags")}'.strip() or platform.processor()
    raw = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}|{CALIBRATION_VERSION}"
    caps = isa_caps()
    if caps:  # only then: an uncapped machine keeps the calibrations it has cached
        raw += "|" + ",".join(f"{k}={v}" for k, v in sorted(caps.items()))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """The machine's cache folder (calibrations, compiled kernels, model files)."""
    return Path(os.environ.get("SPECDEC_CACHE") or os.path.expanduser("~/.cache/specdec"))


def _cache_file() -> Path:
    return cache_root() / "calibration" / f"{machine_key()}.json"


@contextlib.contextmanager
def file_lock(path: Path):
    """Holds an exclusive lock beside a cache file: replicas that load together on one
    machine calibrate once and read the same choice (kernels measured apart can differ by
    timing noise, and a request failing over between them would change its bits), and
    build a compiled kernel once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as e:  # a read-only home: no cache, no lock
        logger.warning("could not lock %s: %s", path, e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def calibrate(shapes: Sequence[tuple[int, int]], fmt: str, *, use_cache: bool = True,
              check_rows: int = 32) -> dict[tuple[int, int], ShapeCalibration]:
    """Calibrations for every distinct shape, from the machine's cache where present."""
    distinct = list(dict.fromkeys(tuple(s) for s in shapes))
    if not use_cache:
        return {s: calibrate_shape(s, fmt, check_rows=check_rows) for s in distinct}
    path = _cache_file()
    with file_lock(path):
        return _calibrate_cached(path, distinct, fmt, check_rows)


def _calibrate_cached(path: Path, shapes: list[tuple[int, int]], fmt: str, check_rows: int):
    cache = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    out, changed = {}, False
    for shape in shapes:
        key = f"{fmt}:{shape[0]}x{shape[1]}:{check_rows}"
        if key in cache:
            c = cache[key]
            out[shape] = ShapeCalibration(tuple(c["shape"]), c["format"], c["ms"], c["invariant"],
                                          c["fastest"], c["fastest_invariant"], c.get("pad_to", {}))
            continue
        started = time.perf_counter()
        out[shape] = calibrate_shape(shape, fmt, check_rows=check_rows)
        logger.info("calibrated %s %s in %.1f s: fastest %s, fastest invariant %s", fmt, shape,
                    time.perf_counter() - started, out[shape].fastest, out[shape].fastest_invariant)
        cache[key] = asdict(out[shape])
        changed = True
    if changed:
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as e:  # a read-only home: calibrate again next time
            logger.warning("could not cache the kernel calibration in %s: %s", path, e)
    return out


def forward_ms(cal: dict[tuple[int, int], ShapeCalibration], counts: dict[tuple[int, int], int],
               invariant: bool) -> list[float] | None:
    """Estimated ms of the model's matmuls at COST_ROWS with the chosen kernels (None when
    a shape has no invariant kernel and invariance is asked for)."""
    total = [0.0] * len(COST_ROWS)
    for shape, n in counts.items():
        c = cal[shape]
        name = c.fastest_invariant if invariant else c.fastest
        if name is None:
            return None
        total = [t + n * m for t, m in zip(total, c.ms[name])]
    return total
