#!/usr/bin/env bash
# Builds the image (docker/Dockerfile, through docker/build.sh --engine podman) on a stand-in for NGC's JAX
# base (docker/standin: Debian trixie from debootstrap, JAX as NGC pins it, a Transformer Engine record, a
# stub libnccl.so.2, Ubuntu 24.04's uid-1000 user), then runs in it as its non-root user: `maxtext-moe
# doctor`, `maxtext-moe recipes` and the CPU default `train` for a few steps, its run directory on a mounted
# volume that this script then reads, as pyxis and Kubernetes mount checkpoints. .ci/run runs it. Each
# image is removed after its checks, so that the builds need room for one image at a time (about 6 GiB).
#
#   scripts/image_smoke.sh            # needs root, podman, runc and debootstrap; says so in one line and
#                                     # exits 0 where they are missing
# The stand-in's root file system is kept as the podman image localhost/maxtext-moe-standin-root:trixie
# (debootstrap, about 2.5 minutes, once per machine); MAXTEXT_MOE_IMAGE_WORK (default
# /var/tmp/maxtext-moe-image) holds the run directory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${MAXTEXT_MOE_IMAGE_WORK:-/var/tmp/maxtext-moe-image}"
root_image=localhost/maxtext-moe-standin-root:trixie
base_image=localhost/maxtext-moe-standin:ngc-like

missing=()
for tool in podman runc debootstrap cc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [[ $(id -u) != 0 ]]; then missing+=("root"); fi
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "image_smoke.sh: skipped: needs ${missing[*]} (as root: apt-get install podman runc debootstrap gcc)"
  exit 0
fi
if [[ ! -f /etc/containers/containers.conf ]]; then
  # This VM: crun refuses its hybrid cgroups, and podman's default file limit is above its hard limit.
  mkdir -p /etc/containers
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' \
    >/etc/containers/containers.conf
fi
mkdir -p "$work"

# Each build writes its pip layer (about 1.1 GB) three times over while podman commits it: the container's
# upper directory, the layer's blob under /var/tmp, the stored layer. Too little room is said here in one
# line, not found out as "no space left on device" minutes into pip.
need_gib=6
for dir in "$(podman info --format '{{.Store.GraphRoot}}')" /var/tmp; do
  mkdir -p "$dir"
  free_gib=$(($(df --output=avail -B1 "$dir" | tail -1) / 1024 ** 3))
  if ((free_gib < need_gib)); then
    echo "image_smoke.sh: $free_gib GiB free on $dir's file system; the image build needs about $need_gib GiB (free some, or remove old images: podman system prune)" >&2
    exit 1
  fi
done

if ! podman image exists "$root_image"; then
  rootfs="$(mktemp -d "$work/rootfs.XXXXXX")"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,passwd trixie "$rootfs" \
    http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { echo "image_smoke.sh: debootstrap failed (see $work/debootstrap.log)" >&2; exit 1; }
  tar -C "$rootfs" -c . | podman import - "$root_image" >/dev/null
  rm -rf "$rootfs"
fi
context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
cp "$repo"/docker/standin/{Containerfile,jax-pins.txt,te-record.txt} "$context/"
cc -shared -fPIC -O2 -Wl,-soname,libnccl.so.2 -o "$context/libnccl.so.2" "$repo/docker/standin/nccl.c"
# The package index as this machine reaches it: its network and its certificates (a proxy may sign them).
net=(--network host -v /etc/ssl/certs:/etc/ssl/certs:ro)
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")"
image="maxtext-moe:$version"

smoke() {  # doctor, recipes and 5 train steps in the image, as its user, the run on a mounted volume
  local runs="$work/runs" metrics owner
  rm -rf "$runs" && mkdir -p "$runs" && chmod 0777 "$runs"
  run() { podman run --rm --network none -v "$runs:/runs" -w /runs "$image" "$@"; }
  run doctor >"$work/doctor.txt"
  run recipes >"$work/recipes.txt"
  grep -q "gb300x128/deepseek3-671b" "$work/recipes.txt" || { echo "image_smoke.sh: recipes lists no gb300x128" >&2; return 1; }
  run train steps=5 run_name=image-smoke >"$work/train.txt" 2>&1 \
    || { tail -5 "$work/train.txt" >&2; echo "image_smoke.sh: train failed in the image" >&2; return 1; }
  metrics="$(find "$runs" -name metrics.jsonl | head -1)"
  if [[ -z "$metrics" ]] || [[ "$(grep -c '"step"' "$metrics")" -lt 5 ]]; then
    echo "image_smoke.sh: the run directory on the volume holds no 5 steps of metrics ($runs)" >&2
    return 1
  fi
  owner="$(stat -c %u "$metrics")"
  echo "image_smoke.sh: doctor, recipes and 5 train steps as uid $owner; the host reads $metrics"
}

# Ubuntu 24.04's uid-1000 user in the base (NGC's JAX images are built on it), then none.
for ubuntu_user in 1 0; do
  start=$SECONDS
  base="$base_image-u$ubuntu_user"
  podman build --format docker -q "${net[@]}" --build-arg "UBUNTU_USER=$ubuntu_user" -f "$context/Containerfile" \
    -t "$base" "$context" >/dev/null
  "$repo/docker/build.sh" --engine podman --base "$base" -- "${net[@]}" >"$work/build.log" 2>&1 \
    || { tail -5 "$work/build.log" >&2; echo "image_smoke.sh: the image did not build (see $work/build.log)" >&2; exit 1; }
  echo "image_smoke.sh: $image built on the stand-in (a uid-1000 user in the base: $ubuntu_user) in $((SECONDS - start)) s"
  start=$SECONDS
  smoke
  echo "image_smoke.sh: ... in $((SECONDS - start)) s"
  # This build's image, its base and the build's intermediate layers go before the next build writes its own.
  podman rmi -f "$(podman image inspect --format '{{.Id}}' "$image")" "$base" >/dev/null  # every tag of it
  podman image prune -f >/dev/null
  rm -rf "$work/runs"
done

# A base whose NCCL is too old for TE's NCCL EP: the build stops at its first step, in one line.
start=$SECONDS
cc -shared -fPIC -O2 -DNCCL_CODE=22801 -Wl,-soname,libnccl.so.2 -o "$context/libnccl.so.2" "$repo/docker/standin/nccl.c"
podman build --format docker -q "${net[@]}" --build-arg UBUNTU_USER=0 -f "$context/Containerfile" \
  -t "$base_image-old-nccl" "$context" >/dev/null
if "$repo/docker/build.sh" --engine podman --base "$base_image-old-nccl" -- "${net[@]}" >"$work/build-old.log" 2>&1; then
  echo "image_smoke.sh: the image built on a base with NCCL 2.28.1" >&2
  exit 1
fi
want="pins.py: the base image's NCCL 2.28.1 is older than 2.30.4, which TE's NCCL EP needs: use a newer base"
grep -qxF "$want" "$work/build-old.log" || { echo "image_smoke.sh: no '$want' (see $work/build-old.log)" >&2; exit 1; }
echo "image_smoke.sh: a base with NCCL 2.28.1 fails the build in one line, in $((SECONDS - start)) s"
podman rmi -f "$base_image-old-nccl" >/dev/null
podman image prune -f >/dev/null
