#!/usr/bin/env bash
# Set-up of one node of the GPU cluster (cluster/aws_gpu_cluster.yaml runs it; the KubeRay
# models Job runs it with --no-install):
#   node_setup.sh [--no-install] head|draft|target|all
# 1. installs this project (pip install -e, CUDA torch from PyPI) unless --no-install;
# 2. fetches into $SPECDEC_MODELS (default /mnt/models) what the node's role needs:
#      every role: config + tokenizer files of both models (a Coordinator may land anywhere)
#      draft:  the draft weights      target: the target weights      all: both
# Folder names must match draft.model / target.model in configs/gpu_llama3_70b.yaml.
set -euo pipefail
install=1
if [ "${1:-}" = "--no-install" ]; then install=0; shift; fi
role=${1:?usage: node_setup.sh [--no-install] head|draft|target|all}
root=$(cd "$(dirname "$0")/.." && pwd)
models=${SPECDEC_MODELS:-/mnt/models}
draft_repo=${SPECDEC_DRAFT_REPO:-meta-llama/Meta-Llama-3-8B-Instruct}
target_repo=${SPECDEC_TARGET_REPO:-meta-llama/Meta-Llama-3-70B-Instruct}

if [ "$install" = 1 ]; then
  python -m pip install -q -e "$root"
fi

fetch() {  # repo, weights: 1 = config + tokenizer + safetensors, 0 = config + tokenizer
  python - "$1" "$models/$(basename "$1")" "$2" <<'PY'
import sys
from huggingface_hub import snapshot_download

repo, dest, weights = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
patterns = ["*.json", "tokenizer*"] + (["*.safetensors"] if weights else [])
snapshot_download(repo, local_dir=dest, allow_patterns=patterns)
print(f"{repo} -> {dest} ({'weights' if weights else 'config and tokenizer'})")
PY
}

mkdir -p "$models"
case "$role" in
  head)   fetch "$draft_repo" 0; fetch "$target_repo" 0 ;;
  draft)  fetch "$draft_repo" 1; fetch "$target_repo" 0 ;;
  target) fetch "$draft_repo" 0; fetch "$target_repo" 1 ;;
  all)    fetch "$draft_repo" 1; fetch "$target_repo" 1 ;;
  *) echo "unknown role: $role" >&2; exit 2 ;;
esac
