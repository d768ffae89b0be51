#!/usr/bin/env bash
# Pack what hack/build-deepgemm.py needs from a DeepGEMM checkout with its submodules
# (git clone --recursive https://github.com/deepseek-ai/DeepGEMM) into .dg/deepgemm.tgz, the
# bundle bench/device_env.sh builds on a GPU machine that cannot fetch it (3 MB).
#   bash hack/deepgemm-bundle.sh DEEPGEMM_DIR
set -euo pipefail
src=$(realpath "${1:?usage: hack/deepgemm-bundle.sh DEEPGEMM_DIR}")
cd "$(dirname "$0")/.."
for p in csrc deep_gemm third-party/cutlass/include third-party/fmt/include; do
  [[ -e $src/$p ]] || { echo "deepgemm-bundle: $src has no $p (a checkout with its submodules?)" >&2; exit 2; }
done
mkdir -p .dg
# a built checkout's extension and copied CUTLASS headers stay out: the GPU machine builds its own
tar czf .dg/deepgemm.tgz -C "$src" --transform 's,^,deepgemm/,' --exclude=__pycache__ \
  --exclude='deep_gemm/_C*.so' --exclude=deep_gemm/include/cute --exclude=deep_gemm/include/cutlass \
  csrc deep_gemm third-party/cutlass/include third-party/fmt/include
echo "deepgemm-bundle: .dg/deepgemm.tgz ($(du -h .dg/deepgemm.tgz | cut -f1)) from $src ($(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
