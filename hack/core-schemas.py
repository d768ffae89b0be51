#!/usr/bin/env python3
"""Print core/v1 types as structural CRD schemas (the pod fields spec.pod carries, and the
security contexts), from a Kubernetes release's OpenAPI v3 document, for pasting into
manifests/crd/. References are inlined; descriptions and defaults are dropped (the apiserver
defaults these fields again in the Deployment the operator renders); only the keys a CRD schema
may hold are kept.

Usage: hack/core-schemas.py PATH/api__v1_openapi.json Toleration Affinity ...
  (the document is in the kubernetes source tree: api/openapi-spec/v3/api__v1_openapi.json)
"""

from __future__ import annotations

import copy
import json
import sys

import yaml

KEPT = ("type", "format", "enum", "required", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type", "x-kubernetes-int-or-string")
CORE = "io.k8s.api.core.v1."


def structural(node: dict, schemas: dict) -> dict:
    refs = [part["$ref"] for part in node.get("allOf", []) if "$ref" in part]
    if "$ref" in node:
        refs.append(node["$ref"])
    out: dict = {}
    for ref in refs:
        out.update(structural(schemas[ref.rsplit("/", 1)[1]], schemas))
    for key in KEPT:
        if key in node:
            out[key] = copy.deepcopy(node[key])  # no shared lists: they would become YAML aliases
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: structural(v, schemas) for k, v in sorted(node["properties"].items())}
    if "items" in node:
        out["items"] = structural(node["items"], schemas)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], schemas)
    return out


def main() -> None:
    schemas = json.load(open(sys.argv[1]))["components"]["schemas"]
    for name in sys.argv[2:]:
        full = name if "." in name else CORE + name
        print(f"# {name}")
        print(yaml.safe_dump(structural(schemas[full], schemas), sort_keys=False, default_flow_style=None, width=120))


if __name__ == "__main__":
    main()
