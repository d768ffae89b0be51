"""A local node for operator tests: a LocalKubelet that runs the engine pods for real."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from demo_pair import IMAGE_DEMO_DIR
from specdeploy.localcluster.kubelet import LocalKubelet


@contextlib.contextmanager
def local_node(kube_cluster, workdir: Path, demo_pair: Path, **kubelet_options: Any) -> Iterator[LocalKubelet]:
    """A node that runs pods for real, with the image's demo pair at its path and `specdeploy` as
    the image's PATH has it (this interpreter's environment); the fake GPU nodes are cordoned
    meanwhile, so the CPU-mode engine (no node affinity) lands here."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    kubelet = LocalKubelet(kube_cluster, workdir, image_paths={IMAGE_DEMO_DIR: demo_pair}, path=path, **kubelet_options)
    kubelet.start()
    cordoned = kubelet.cordon_others()
    try:
        yield kubelet
    finally:
        kubelet.uncordon(cordoned)
        kubelet.stop()
