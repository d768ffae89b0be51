#!/usr/bin/env bash
# Build the operator and engine images without a Docker engine or a container registry: buildah
# (a Debian package) builds Dockerfile.operator and Dockerfile.engine, FROM a Debian bookworm base
# image that debootstrap makes here from Debian's own mirror (python3 + venv + CA certificates).
# Python packages come from PyPI, as pip is configured on this machine (its CA bundle and index
# settings are mounted into each RUN step).
#
# Usage: hack/build-images.sh [operator] [engine]     (default: both)
#   IMAGE_TAG            tag of both images (default: dev)
#   DEBIAN_MIRROR        default http://deb.debian.org/debian
#   TORCH_INDEX_URL      index torch is installed from in the engine image (default: PyPI, whose
#                        Linux wheels bring their CUDA libraries)
#   SPECDEPLOY_IMAGES_DIR where the base image's root file system is made (default ~/.cache/specdeploy/images)
#
# The base is reused while its root file system is cached. Images land in buildah's local
# storage (`buildah images`); `podman run` runs them where the machine can run containers.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${SPECDEPLOY_IMAGES_DIR:-${HOME}/.cache/specdeploy/images}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tag="${IMAGE_TAG:-dev}"
base="localhost/specdeploy/debian-python:bookworm"
targets=("$@")
(( ${#targets[@]} )) || targets=(operator engine)

say() { printf '[build-images %4ds] %s\n' "$SECONDS" "$*"; }

need=()
for tool in buildah debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if (( ${#need[@]} )); then
  [[ $(id -u) == 0 ]] || { echo "build-images: install ${need[*]} (apt-get install ${need[*]})" >&2; exit 2; }
  say "installing ${need[*]}"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi

# Root without a container engine: chroot isolation and the vfs driver need no kernel overlay,
# user namespace or cgroup set-up beyond what a build machine has.
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"

mkdir -p "$work"
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  rootfs="$work/rootfs-bookworm"
  if [[ ! -x "$rootfs/usr/bin/python3" ]]; then
    say "debootstrap bookworm from $mirror"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
      bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
      || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
  fi
  say "importing the root file system as $base"
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$rootfs"/. "$mnt"/
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd /bin/bash --label org.opencontainers.image.description="Debian bookworm (debootstrap) + python3" "$ctr"
  buildah commit --rm "$ctr" "$base" >/dev/null
fi

# pip inside the build as pip is here: the same CA bundle and index settings.
pip_conf="$work/pip.conf"
{
  echo "[global]"
  echo "cert = /etc/ssl/certs/ca-certificates.crt"
  [[ -n "${PIP_INDEX_URL:-}" ]] && echo "index-url = ${PIP_INDEX_URL}"
  [[ -n "${PIP_EXTRA_INDEX_URL:-}" ]] && echo "extra-index-url = ${PIP_EXTRA_INDEX_URL}"
  echo "timeout = 180"
} >"$pip_conf"
mounts=(--volume "$pip_conf:/etc/pip.conf:ro")
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && mounts+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

for target in "${targets[@]}"; do
  case "$target" in
    operator) args=(--build-arg "PYTHON_IMAGE=$base") ;;
    # Debian's python3 + PyPI's torch (whose wheels carry the CUDA runtime) in place of NVIDIA's
    # CUDA base image, which lives on a registry this build may not reach.
    engine) args=(--build-arg "CUDA_IMAGE=$base" --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}") ;;
    *) echo "build-images: unknown image '$target' (operator, engine)" >&2; exit 2 ;;
  esac
  image="localhost/specdeploy/$target:$tag"
  say "building $image from Dockerfile.$target"
  buildah build --layers=false "${mounts[@]}" "${args[@]}" -f "$root/Dockerfile.$target" -t "$image" "$root" \
    >"$work/build-$target.log" 2>&1 || { tail -30 "$work/build-$target.log" >&2; exit 1; }
  say "built $image ($(buildah inspect --type image --format '{{.Docker.Size}}' "$image" 2>/dev/null || echo '?') bytes); log $work/build-$target.log"
done
buildah images --filter reference='localhost/specdeploy/*'
