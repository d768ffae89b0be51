#!/usr/bin/env bash
# Copy the CRDs from their single source, manifests/crd/, into the Helm chart's crds/ folder.
# tests/manifests/test_chart_crds.py fails when the two differ; run this after changing the CRD. It also
# re-renders manifests/install.yaml (which carries the CRD) when helm is available.
#
# Usage: hack/sync-crds.sh [--check]
#   --check   change nothing; exit 1 and name the files that differ
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="${root}/manifests/crd"
dst="${root}/charts/specdeploy/crds"

shopt -s nullglob
sources=("${src}"/*.yaml)
(( ${#sources[@]} )) || { echo "sync-crds: no CRDs in ${src}" >&2; exit 1; }

if [[ "${1:-}" == "--check" ]]; then
  stale=0
  for f in "${sources[@]}"; do
    cmp -s "${f}" "${dst}/$(basename "${f}")" || { echo "stale: ${dst}/$(basename "${f}")"; stale=1; }
  done
  for f in "${dst}"/*.yaml; do
    [[ -e "${src}/$(basename "${f}")" ]] || { echo "no source: ${f}"; stale=1; }
  done
  exit "${stale}"
fi

mkdir -p "${dst}"
# A CRD removed from the source must leave the chart too.
for f in "${dst}"/*.yaml; do
  [[ -e "${src}/$(basename "${f}")" ]] || rm -v "${f}"
done
for f in "${sources[@]}"; do
  cp "${f}" "${dst}/"
  echo "synced ${dst#"${root}/"}/$(basename "${f}")"
done

# manifests/install.yaml carries the CRD too; re-render it when helm is at hand.
if "${root}/hack/render-install.sh" --stdout >/dev/null 2>&1; then
  "${root}/hack/render-install.sh"
else
  echo "sync-crds: no helm; run hack/render-install.sh after 'make tools'" >&2
fi
