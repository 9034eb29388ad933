#!/usr/bin/env bash
# Builds the maxtext-moe image on the pinned NGC JAX base (docker/Dockerfile), tagged with the plugin's
# version and the git commit:
#
#   docker/build.sh [--push REGISTRY] [--base IMAGE] [--dry-run]
#
#   --push REGISTRY   also tag as REGISTRY/maxtext-moe:TAG and push both tags
#   --base IMAGE      another NGC JAX base (default: the Dockerfile's BASE_IMAGE)
#   --dry-run         print the docker commands instead of running them
#
# Tags: maxtext-moe:VERSION and maxtext-moe:VERSION-SHA (SHA with a -dirty suffix for uncommitted changes).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
registry=""
base=""
dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --push) registry="${2:?--push needs a REGISTRY}"; shift 2 ;;
    --base) base="${2:?--base needs an IMAGE}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")"
sha="$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ "$sha" != unknown && -n "$(git -C "$repo" status --porcelain 2>/dev/null)" ]]; then sha="$sha-dirty"; fi
tags=("maxtext-moe:$version" "maxtext-moe:$version-$sha")

run() {
  if [[ "$dry" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

args=(build -f "$repo/docker/Dockerfile" --build-arg "VERSION=$version" --build-arg "GIT_SHA=$sha")
if [[ -n "$base" ]]; then args+=(--build-arg "BASE_IMAGE=$base"); fi
for tag in "${tags[@]}"; do args+=(-t "$tag"); done
run docker "${args[@]}" "$repo"

if [[ -n "$registry" ]]; then
  for tag in "${tags[@]}"; do
    run docker tag "$tag" "$registry/$tag"
    run docker push "$registry/$tag"
  done
fi
