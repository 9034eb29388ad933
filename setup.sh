#!/usr/bin/env bash
# Sets up .venv with pinned dependencies and installs maxtext-moe in editable mode.
#   ./setup.sh          runtime (CPU jax, maxtext, the plugin)
#   ./setup.sh --dev          plus test and lint tools and XLA:GPU's compiler (--gpu-compile)
#   ./setup.sh --gpu-compile  plus XLA:GPU's compiler for `maxtext-moe compile` (no GPU needed)
#   ./setup.sh --gpu-compile-te  a second environment, .venv-te: the compiler and Transformer Engine built
#                             here without a GPU (about 7 GB, 10 minutes), for `.venv-te/bin/maxtext-moe compile`
#   ./setup.sh --gpu          plus CUDA jax and Transformer Engine (needs CUDA 12; not run in CI)
# Idempotent: a second run with the same requirements and flags installs nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

dev=0
gpu=0
compile=0
te_compile=0
venv=.venv
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 compile=1 ;;
    --gpu-compile) compile=1 ;;
    --gpu-compile-te) compile=1 te_compile=1 venv=.venv-te ;;
    --gpu) gpu=1 ;;
    -h | --help)
      sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "setup.sh: unknown option '$arg' (use --dev, --gpu-compile, --gpu-compile-te, --gpu or --help)" >&2
      exit 2
      ;;
  esac
done
if [ "$te_compile" = 1 ] && [ "$gpu" = 1 ]; then
  echo "setup.sh: --gpu-compile-te is for machines without a GPU; with one, use --gpu" >&2
  exit 2
fi

is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  for c in "${PYTHON:-}" python3.13 python3.12; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_py312 "$c" && { command -v "$c"; return 0; }
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
  for c in $(find "$root/versions" -mindepth 1 -maxdepth 1 -name '3.1[2-9]*' 2>/dev/null | sort -rV); do
    is_py312 "$c/bin/python" && { echo "$c/bin/python"; return 0; }
  done
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)" || {
    echo "setup.sh: no Python >= 3.12 found (tried \$PYTHON, python3.13, python3.12, pyenv); install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
    exit 1
  }
  echo "setup.sh: creating $venv with $py ($("$py" --version))"
  "$py" -m venv "$venv"
fi

reqs=(requirements.txt)
[ "$dev" = 1 ] && reqs+=(requirements-dev.txt)
[ "$compile" = 1 ] && [ "$gpu" = 0 ] && reqs+=(requirements-gpu-compile.txt)
[ "$gpu" = 1 ] && reqs+=(requirements-gpu.txt)
[ "$te_compile" = 1 ] && reqs+=(requirements-gpu-compile-te.txt)
stamp="$venv/.maxtext-moe-installed-$(cat "${reqs[@]}" constraints.txt pyproject.toml scripts/cuda_stub.c | sha256sum | cut -c1-16)-d${dev}c${compile}g${gpu}t${te_compile}"
if [ -f "$stamp" ]; then
  echo "setup.sh: $venv is up to date"
  exit 0
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip==26.3"
args=()
for r in "${reqs[@]}"; do args+=(-r "$r"); done
# The GPU set brings its own CUDA wheels that the CPU constraints do not list.
if [ "$gpu" = 1 ]; then "${pip[@]}" install "${args[@]}"; else "${pip[@]}" install -c constraints.txt "${args[@]}"; fi
if [ "$te_compile" = 1 ]; then
  # TE's JAX extension, built against the CUDA 12 wheels just installed (not /usr/local/cuda, which may hold
  # another CUDA); Hopper and Blackwell, with NCCL EP. TE looks for the runtime under nvidia/cuda_cudart,
  # which the cu12 wheel names nvidia/cuda_runtime.
  echo "setup.sh: building transformer-engine-jax 2.20.2 (about 5 minutes)"
  NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_CUDA_ARCHS="90;100" MAX_JOBS="$(nproc)" \
    "${pip[@]}" install --no-build-isolation --no-deps "transformer-engine-jax==2.20.2"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  ln -sfn cuda_runtime "$site/nvidia/cuda_cudart"
  mkdir -p "$venv/lib/maxtext-moe-cuda-stub"
  cc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$venv/lib/maxtext-moe-cuda-stub/libcuda.so.1" scripts/cuda_stub.c
fi
"${pip[@]}" install --no-deps -e .
rm -f "$venv"/.maxtext-moe-installed-*
touch "$stamp"
echo "setup.sh: done; run $venv/bin/maxtext-moe --help"
