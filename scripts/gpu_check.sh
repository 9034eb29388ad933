#!/usr/bin/env bash
# The prepared GPU check: grouped-GEMM efficiency per backend at DeepSeek-V3's expert shape, our MoE layer
# against MaxText's, and what `auto` picks on this machine. Results: OUT/gpu_check.json and
# OUT/gpu_check.txt (the table, also printed). Stops itself after 470 s.
#
#   scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--cpu-smoke]
#
#   --out DIR      where the results go (default: $OUT if set, else ./gpu_check_out)
#   --wheels DIR   install DIR/*.whl (no index, no dependencies) into a temporary directory first: how
#                  maxtext and what it needs reach a bare CUDA JAX machine that reaches no package index
#   --cpu-smoke    toy shapes on CPU (CI runs this)
#
# In the container: scripts/gpu_check.sh --out /results. Python: $PYTHON, else the repo's .venv, else
# python3.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$PWD/gpu_check_out}"
wheels=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --cpu-smoke) args+=("--cpu-smoke"); shift ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi

if [[ -n "$wheels" ]]; then
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "gpu_check.sh: no wheels in $wheels" >&2
    exit 2
  fi
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 DECOUPLE_GCLOUD=TRUE TF_CPP_MIN_LOG_LEVEL=1

mkdir -p "$out"
timeout 470 "$python" -m maxtext_moe.bench.gpu_check --out "$out" --budget-s 400 "${args[@]}"
