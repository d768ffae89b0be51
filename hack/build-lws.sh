#!/usr/bin/env bash
# Build the LeaderWorkerSet controller (sigs.k8s.io/lws, version LWS_VERSION of
# hack/tools-versions.env) from its Go module, as hack/build-tools.sh builds the control plane,
# and cache it outside the repo:
#
#   $SPECDEPLOY_TOOLS_DIR (default ~/.cache/specdeploy/tools)/lws-<v>/lws-controller
#
# Built only when missing (a warm run takes a second); about 6 minutes cold on 2 busy cores.
# Usage: hack/build-lws.sh [--print-path]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools-versions.env
source "${here}/tools-versions.env"
TOOLS_DIR="${SPECDEPLOY_TOOLS_DIR:-${HOME}/.cache/specdeploy/tools}"
DEST="${TOOLS_DIR}/lws-${LWS_VERSION}"
BIN="${DEST}/lws-controller"

if [[ "${1:-}" == "--print-path" ]]; then
  echo "${BIN}"
  exit 0
fi
[[ -x "${BIN}" ]] && { echo "build-lws: lws ${LWS_VERSION}: cached (${BIN})"; exit 0; }
command -v go >/dev/null || { echo "build-lws: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }

export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
t0=$SECONDS
src="$(go mod download -json "sigs.k8s.io/lws@${LWS_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -d "${src}" ]] || { echo "build-lws: cannot download sigs.k8s.io/lws@${LWS_VERSION}" >&2; exit 1; }
tmp="${DEST}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}"
echo "build-lws: building sigs.k8s.io/lws@${LWS_VERSION}/cmd (log: ${tmp}/build.log)"
# The module's own go.mod and go.sum pin every dependency; -mod=mod only lets go read them from
# the read-only module cache.
(cd "${src}" && nice -n "${TOOLS_NICE:-10}" go build -mod=mod -ldflags "-s -w" -o "${tmp}/lws-controller" ./cmd) \
  >"${tmp}/build.log" 2>&1 || { tail -n 40 "${tmp}/build.log" >&2; exit 1; }
rm -rf "${DEST}"; mv "${tmp}" "${DEST}"
echo "build-lws: lws ${LWS_VERSION}: built in $((SECONDS - t0))s (${BIN})"
