#!/usr/bin/env bash
# Builds the maxtext-moe image on the pinned NGC JAX base (docker/Dockerfile), tagged with the plugin's
# version and the git commit:
#
#   docker/build.sh [--push REGISTRY] [--base IMAGE] [--engine docker|podman] [--dry-run] [-- BUILD-OPTIONS]
#
#   --push REGISTRY   also tag as REGISTRY/maxtext-moe:TAG and push both tags
#   --base IMAGE      another NGC JAX base (default: the Dockerfile's BASE_IMAGE)
#   --engine NAME     docker or podman (default: docker where it is installed, else podman); podman builds
#                     in Docker's image format, which keeps the Dockerfile's SHELL (OCI's ignores it)
#   --dry-run         print the commands instead of running them
#   -- BUILD-OPTIONS  passed to the engine's build as they are (e.g. -- --network host)
#
# Tags: maxtext-moe:VERSION and maxtext-moe:VERSION-SHA (SHA with a -dirty suffix for uncommitted changes).
# For enroot (pyxis on SLURM): build with either engine, then `enroot import dockerd://maxtext-moe:TAG`
# (docker) or `enroot import podman://maxtext-moe:TAG` (podman).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
registry=""
base=""
engine=""
extra=()
dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --push) registry="${2:?--push needs a REGISTRY}"; shift 2 ;;
    --base) base="${2:?--base needs an IMAGE}"; shift 2 ;;
    --engine) engine="${2:?--engine needs docker or podman}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -z "$engine" ]]; then
  if command -v docker >/dev/null; then engine=docker; elif command -v podman >/dev/null; then engine=podman; fi
fi
case "$engine" in
  docker | podman) ;;
  "") echo "build.sh: neither docker nor podman is installed (install one, or pass --engine)" >&2; exit 2 ;;
  *) echo "build.sh: --engine must be docker or podman, not '$engine'" >&2; exit 2 ;;
esac

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")"
sha="$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ "$sha" != unknown && -n "$(git -C "$repo" status --porcelain 2>/dev/null)" ]]; then sha="$sha-dirty"; fi
tags=("maxtext-moe:$version" "maxtext-moe:$version-$sha")

run() {
  if [[ "$dry" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

args=(build -f "$repo/docker/Dockerfile")
if [[ "$engine" == podman ]]; then args+=(--format docker); fi
args+=(--build-arg "VERSION=$version" --build-arg "GIT_SHA=$sha")
if [[ -n "$base" ]]; then args+=(--build-arg "BASE_IMAGE=$base"); fi
for tag in "${tags[@]}"; do args+=(-t "$tag"); done
args+=("${extra[@]}")
run "$engine" "${args[@]}" "$repo"

if [[ -n "$registry" ]]; then
  for tag in "${tags[@]}"; do
    run "$engine" tag "$tag" "$registry/$tag"
    run "$engine" push "$registry/$tag"
  done
fi
