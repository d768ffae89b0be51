#!/usr/bin/env bash
# Build prometheus-adapter (sigs.k8s.io/prometheus-adapter, version PROMETHEUS_ADAPTER_VERSION of
# hack/tools-versions.env) from its Go module, as hack/build-lws.sh builds the LeaderWorkerSet
# controller, and cache it outside the repo:
#
#   $SPECDEPLOY_TOOLS_DIR (default ~/.cache/specdeploy/tools)/prometheus-adapter-<v>/adapter
#
# `go install ...@<v>` is not used: it asks the module proxy for the module's deprecation notice,
# which the proxy may refuse; `go mod download` fetches the pinned version alone.
# Built only when missing (a warm run takes a second); about 10 minutes cold on 2 busy cores (628 s
# measured).
# Usage: hack/build-prometheus-adapter.sh [--print-path]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools-versions.env
source "${here}/tools-versions.env"
TOOLS_DIR="${SPECDEPLOY_TOOLS_DIR:-${HOME}/.cache/specdeploy/tools}"
DEST="${TOOLS_DIR}/prometheus-adapter-${PROMETHEUS_ADAPTER_VERSION}"
BIN="${DEST}/adapter"
MODULE=sigs.k8s.io/prometheus-adapter

if [[ "${1:-}" == "--print-path" ]]; then
  echo "${BIN}"
  exit 0
fi
[[ -x "${BIN}" ]] && { echo "build-prometheus-adapter: ${PROMETHEUS_ADAPTER_VERSION}: cached (${BIN})"; exit 0; }
command -v go >/dev/null || { echo "build-prometheus-adapter: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }

export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
t0=$SECONDS
src="$(go mod download -json "${MODULE}@${PROMETHEUS_ADAPTER_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -d "${src}" ]] || { echo "build-prometheus-adapter: cannot download ${MODULE}@${PROMETHEUS_ADAPTER_VERSION}" >&2; exit 1; }
tmp="${DEST}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}/src"
# A writable copy of the module, so go may record what it resolves; its go.mod and go.sum pin
# every dependency.
cp -R "${src}/." "${tmp}/src/"; chmod -R u+w "${tmp}/src"
echo "build-prometheus-adapter: building ${MODULE}@${PROMETHEUS_ADAPTER_VERSION}/cmd/adapter (log: ${tmp}/build.log)"
(cd "${tmp}/src" && nice -n "${TOOLS_NICE:-10}" go build -mod=mod -ldflags "-s -w" -o "${tmp}/adapter" ./cmd/adapter) \
  >"${tmp}/build.log" 2>&1 || { tail -n 40 "${tmp}/build.log" >&2; exit 1; }
rm -rf "${tmp}/src"
rm -rf "${DEST}"; mv "${tmp}" "${DEST}"
echo "build-prometheus-adapter: ${PROMETHEUS_ADAPTER_VERSION}: built in $((SECONDS - t0))s (${BIN})"
