"""A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok) for tests, with fake GPU nodes. See tests/cluster/README.md for how to use it."""

from .cluster import DEFAULT_NODES, FakeNode, KubeCluster, KubectlError, wait_for
from .tools import Tools, ToolsMissing

__all__ = [
    "DEFAULT_NODES",
    "FakeNode",
    "KubeCluster",
    "KubectlError",
    "Tools",
    "ToolsMissing",
    "wait_for",
]
