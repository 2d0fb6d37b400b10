"""The compiled paged attention (paged_attention.c), built on first use with the machine's C
compiler and loaded through ctypes.

Why C: the attention's torch formulation (specdec/attention.py) runs about 30 small tensor
operations per layer, each dominated by dispatch, whatever the rows; on a 2-core CPU that is
a quarter of a 0.5B draft's decode step. The C loop computes every (row, head) in one call,
in an order that depends on nothing but the row's own position (the invariance the sampler's
seeds rely on).

Why ctypes and a plain compiler call, not a torch C++ extension: no Python headers, no
ninja, no torch headers, and a build of about a second. The library is cached per source,
flags and CPU (it is built for the CPU it runs on, -march=native) beside the kernel
calibration; replicas that start together build it once (a file lock). Where no compiler
is found or the build fails, `load()` returns None and the torch formulation runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu11", "-fPIC", "-shared", "-pthread")
# Where -march=native is not understood: a portable build.
FALLBACK_FLAGS = ("-O3", "-ffp-contract=fast", "-std=gnu11", "-fPIC", "-shared", "-pthread")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _ptr,
             _i64, _ptr, ctypes.c_int]


def build_flags() -> tuple[tuple[str, ...], ...]:
    """The flag sets to try in turn. Under ATen's AVX2 cap (kernels.ISA_CAPS) the native
    build leaves AVX-512 out too, as it would be on an AVX2-only CPU."""
    from specdec import kernels

    if "avx512f" in kernels.cpuinfo("flags").split() and "avx512f" not in kernels.cpu_flags():
        return (FLAGS + ("-mno-avx512f",), FALLBACK_FLAGS)
    return (FLAGS, FALLBACK_FLAGS)


def _library_path(flags) -> Path:
    from specdec import kernels  # the calibration's cache folder and CPU description

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()
                         + kernels.cpuinfo("model name").encode() + kernels.cpuinfo("flags").encode())
    return kernels.cache_root() / "native" / f"paged_attention-{key.hexdigest()[:16]}.so"


def _build(path: Path, flags) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc; set CC)")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, *flags, str(SOURCE), "-o", str(tmp), "-lm"], check=True,
                   capture_output=True, text=True, timeout=300)
    tmp.replace(path)


@cache
def load():
    """The loaded library's entry point, or None (logged once) where it cannot be built."""
    from specdec import kernels

    if os.environ.get("SPECDEC_ATTENTION", "auto") == "torch":
        return None
    errors = []
    for flags in build_flags():
        path = _library_path(flags)
        try:
            with kernels.file_lock(path):
                if not path.is_file():
                    _build(path, flags)
            fn = ctypes.CDLL(str(path)).specdec_paged_attention  # CDLL: the GIL is released
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or ""
            errors.append(f"{' '.join(flags)}: {e} {detail.strip()[-300:]}")
            continue
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        logger.info("compiled paged attention: %s", path)
        return fn
    logger.warning("the compiled paged attention could not be built; the torch formulation "
                   "runs instead (slower on CPUs): %s", "; ".join(errors))
    return None
