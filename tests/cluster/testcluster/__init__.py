"""A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok) for tests, with fake GPU nodes: the package's local cluster (specdeploy.localcluster) as
pytest fixtures. See tests/cluster/README.md for how to use it."""

from specdeploy.localcluster.controlplane import DEFAULT_NODES, FakeNode, KubeCluster, KubectlError, wait_for
from specdeploy.localcluster.tools import Tools, ToolsMissing

__all__ = [
    "DEFAULT_NODES",
    "FakeNode",
    "KubeCluster",
    "KubectlError",
    "Tools",
    "ToolsMissing",
    "wait_for",
]
