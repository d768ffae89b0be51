#!/usr/bin/env bash
# Build the Kubernetes test control plane from Go module registry packages only, and cache it
# outside the repo, keyed by version:
#
#   $SPECDEPLOY_TOOLS_DIR (default ~/.cache/specdeploy/tools)/
#     kubernetes-<v>/{kube-apiserver,kube-controller-manager,kube-scheduler,kubectl}
#     etcd-<v>/{etcd,etcdctl}
#     kwok-<v>/{kwok,kwokctl}
#     helm-<v>/helm
#
# Each group is built only when one of its binaries is missing, so a warm run takes a second.
# Versions live in hack/tools-versions.env (the pytest fixture reads the same file).
#
# Usage: hack/build-tools.sh [--print-dir]
#   --print-dir   print the cache directory and exit
# Env:   SPECDEPLOY_TOOLS_DIR  cache root
#        TOOLS_NICE            niceness for the Go builds (default 10)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools-versions.env
source "${here}/tools-versions.env"

TOOLS_DIR="${SPECDEPLOY_TOOLS_DIR:-${HOME}/.cache/specdeploy/tools}"
NICE="${TOOLS_NICE:-10}"

if [[ "${1:-}" == "--print-dir" ]]; then
  echo "${TOOLS_DIR}"
  exit 0
fi

command -v go >/dev/null || { echo "build-tools: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }

K8S_DIR="${TOOLS_DIR}/kubernetes-${K8S_VERSION}"
ETCD_DIR="${TOOLS_DIR}/etcd-${ETCD_VERSION}"
KWOK_DIR="${TOOLS_DIR}/kwok-${KWOK_VERSION}"
HELM_DIR="${TOOLS_DIR}/helm-${HELM_VERSION}"
SRC_DIR="${TOOLS_DIR}/src"
mkdir -p "${TOOLS_DIR}" "${SRC_DIR}"

export CGO_ENABLED=0
export GOFLAGS="-trimpath -buildvcs=false"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

t_start=$SECONDS
log() { printf '[build-tools %4ds] %s\n' "$((SECONDS - t_start))" "$*"; }

# have DIR BIN... : true when every binary exists and is executable.
have() {
  local dir="$1"; shift
  local b
  for b in "$@"; do [[ -x "${dir}/${b}" ]] || return 1; done
}

# Build into a temporary directory and move into place only on success, so an interrupted
# build never leaves a half-populated cache directory that looks complete.
finish() {
  local tmp="$1" dest="$2"
  rm -rf "${dest}"
  mv "${tmp}" "${dest}"
}

gobuild() { nice -n "${NICE}" go build "$@"; }

build_kubernetes() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
  if have "${K8S_DIR}" "${bins[@]}"; then log "kubernetes ${K8S_VERSION}: cached"; return; fi
  local t0=$SECONDS
  log "kubernetes ${K8S_VERSION}: building ${bins[*]} (the long one: about 8 minutes cold on 2 cores)"
  local mod="${SRC_DIR}/kubernetes-${K8S_VERSION}"
  rm -rf "${mod}"; mkdir -p "${mod}"
  # k8s.io/kubernetes replaces its staging modules (k8s.io/api, ...) with local paths, which a
  # dependency's go.mod cannot do; this wrapper module replaces each with its published v0.Y.Z.
  local gomod
  gomod="$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
  [[ -f "${gomod}" ]] || { echo "build-tools: cannot download k8s.io/kubernetes@${K8S_VERSION}" >&2; exit 1; }
  local staging_version="v0.${K8S_VERSION#v1.}"
  {
    echo "module specdeploy.local/kubernetes-tools"
    echo
    echo "go $(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1/')"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    awk '$2 == "=>" && $3 ~ /^\.\/staging\// { printf "\t%s => %s '"${staging_version}"'\n", $1, $1 }' "${gomod}"
    echo ")"
  } > "${mod}/go.mod"
  log "kubernetes: wrapper module replaces $(grep -c '=>' "${mod}/go.mod") staging modules with ${staging_version}"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local date; date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local ld="-s -w"
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
    ld+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=${date}"
  done
  local tmp="${K8S_DIR}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}"
  (
    cd "${mod}"
    local targets=()
    for b in "${bins[@]}"; do targets+=("k8s.io/kubernetes/cmd/${b}"); done
    local total
    total="$(go list -mod=mod -deps "${targets[@]}" 2>/dev/null | grep -c . || true)"
    log "kubernetes: compiling ${total:-?} packages; full log in ${mod}/build.log"
    # -mod=mod lets go fill in go.sum for exactly the packages built; -v names each finished package.
    gobuild -mod=mod -v -ldflags "${ld}" -o "${tmp}/" "${targets[@]}" >"${mod}/build.log" 2>&1 &
    local pid=$!
    trap 'kill "${pid}" 2>/dev/null || true' EXIT INT TERM
    while kill -0 "${pid}" 2>/dev/null; do
      sleep 30
      log "kubernetes: $(grep -vc '^go: ' "${mod}/build.log" || true)/${total:-?} packages compiled"
    done
    trap - EXIT INT TERM
    if ! wait "${pid}"; then
      echo "build-tools: building kubernetes ${K8S_VERSION} failed; last lines of ${mod}/build.log:" >&2
      tail -n 40 "${mod}/build.log" >&2
      exit 1
    fi
  )
  finish "${tmp}" "${K8S_DIR}"
  log "kubernetes ${K8S_VERSION}: built in $((SECONDS - t0))s"
}

build_etcd() {
  if have "${ETCD_DIR}" etcd etcdctl; then log "etcd ${ETCD_VERSION}: cached"; return; fi
  local t0=$SECONDS
  log "etcd ${ETCD_VERSION}: building etcd, etcdctl"
  local mod="${SRC_DIR}/etcd-${ETCD_VERSION}"
  rm -rf "${mod}"; mkdir -p "${mod}/etcd"
  # etcd's own root module replaces its sub-modules with local paths, so a tiny main of ours
  # calls the server's entry point instead; etcdctl's module has no such replaces.
  cat > "${mod}/go.mod" <<GOMOD
module specdeploy.local/etcd-tools

go $(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1/')

require (
	go.etcd.io/etcd/server/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/etcdctl/v3 ${ETCD_VERSION}
)
GOMOD
  cat > "${mod}/etcd/main.go" <<'GO'
// Command etcd runs the etcd server (built for specdeploy's test control plane).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  local tmp="${ETCD_DIR}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}"
  (
    cd "${mod}"
    # No `go mod tidy`: it would drop the etcdctl requirement (nothing imports a main package),
    # and the build would then resolve etcdctl at its latest version instead of ETCD_VERSION.
    go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" "go.etcd.io/etcd/etcdctl/v3@${ETCD_VERSION}"
    local ld="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_VERSION}"
    gobuild -mod=mod -ldflags "${ld}" -o "${tmp}/etcd" ./etcd
    gobuild -mod=mod -ldflags "${ld}" -o "${tmp}/etcdctl" go.etcd.io/etcd/etcdctl/v3
  )
  finish "${tmp}" "${ETCD_DIR}"
  log "etcd ${ETCD_VERSION}: built in $((SECONDS - t0))s"
}

build_kwok() {
  if have "${KWOK_DIR}" kwok kwokctl; then log "kwok ${KWOK_VERSION}: cached"; return; fi
  local t0=$SECONDS
  log "kwok ${KWOK_VERSION}: building kwok, kwokctl"
  local tmp="${KWOK_DIR}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}"
  GOBIN="${tmp}" nice -n "${NICE}" go install -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}" "sigs.k8s.io/kwok/cmd/kwokctl@${KWOK_VERSION}"
  finish "${tmp}" "${KWOK_DIR}"
  log "kwok ${KWOK_VERSION}: built in $((SECONDS - t0))s"
}

build_helm() {
  if have "${HELM_DIR}" helm; then log "helm ${HELM_VERSION}: cached"; return; fi
  local t0=$SECONDS
  log "helm ${HELM_VERSION}: building helm"
  local tmp="${HELM_DIR}.tmp"; rm -rf "${tmp}"; mkdir -p "${tmp}"
  GOBIN="${tmp}" nice -n "${NICE}" go install \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
  finish "${tmp}" "${HELM_DIR}"
  log "helm ${HELM_VERSION}: built in $((SECONDS - t0))s"
}

log "cache: ${TOOLS_DIR}  ($(go version))"
# Smallest first, so a partial cold build already gives other test folders something to use.
build_kwok
build_etcd
build_helm
build_kubernetes

log "done in $((SECONDS - t_start))s"
echo "binaries:"
printf '  %-60s %s\n' "${K8S_DIR}/kube-apiserver" "$("${K8S_DIR}/kube-apiserver" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${K8S_DIR}/kube-controller-manager" "$("${K8S_DIR}/kube-controller-manager" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${K8S_DIR}/kube-scheduler" "$("${K8S_DIR}/kube-scheduler" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${K8S_DIR}/kubectl" "$("${K8S_DIR}/kubectl" version --client 2>&1 | head -n1)"
printf '  %-60s %s\n' "${ETCD_DIR}/etcd" "$("${ETCD_DIR}/etcd" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${ETCD_DIR}/etcdctl" "$("${ETCD_DIR}/etcdctl" version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${KWOK_DIR}/kwok" "$("${KWOK_DIR}/kwok" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${KWOK_DIR}/kwokctl" "$("${KWOK_DIR}/kwokctl" --version 2>&1 | head -n1)"
printf '  %-60s %s\n' "${HELM_DIR}/helm" "$("${HELM_DIR}/helm" version --short 2>&1 | head -n1)"
