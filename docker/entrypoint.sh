#!/usr/bin/env bash
# The image's entrypoint: NGC's own (/opt/nvidia/nvidia_entrypoint.sh: its banner and its driver and CUDA
# compatibility checks) in front of maxtext-moe where the base has it, maxtext-moe alone where it does not.
set -euo pipefail
if [[ -x /opt/nvidia/nvidia_entrypoint.sh ]]; then
  exec /opt/nvidia/nvidia_entrypoint.sh maxtext-moe "$@"
fi
exec maxtext-moe "$@"
