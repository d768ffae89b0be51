"""`specdeploy cluster up | down | status`: a Kubernetes cluster on this machine (no Docker, no
container runtime): the real control plane, and a local node that runs pods as processes.

Only the standard library at the top (the `specdeploy` parser is built for every subcommand).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cluster", help="a local Kubernetes cluster: control plane + a node that runs pods as processes",
        description="A Kubernetes cluster on this machine, without Docker or a container runtime: the real "
                    "control plane and a local node that runs each pod's command as a process.",
    )
    sub = parser.add_subparsers(dest="cluster_command", required=True, metavar="{up,down,status,env}")
    up = sub.add_parser("up", help="start the cluster (builds the control-plane tools the first time: minutes)")
    up.add_argument("--port", type=int, default=None, help="kube-apiserver port on 127.0.0.1 (default 6443)")
    up.add_argument("--image-path", action="append", default=[], metavar="IMAGE_PATH=HOST_PATH",
                    help="where a path of the images is on this machine (repeatable; default: "
                         "/opt/specdeploy/demo=the demo pair's cache)")
    sub.add_parser("down", help="stop the cluster and remove everything it made (also after a crash)")
    sub.add_parser("status", help="is it running; its nodes")
    sub.add_parser("env", help="print the export line (eval \"$(specdeploy cluster env)\")")
    node = sub.add_parser("node", help=argparse.SUPPRESS)  # the node process `up` starts
    node.add_argument("--dir", type=Path, required=True)
    for p in sub.choices.values():
        p.add_argument("--name", default="local", help="cluster name (default %(default)s)")
    parser.set_defaults(func=main)
    return parser


def say(line: str) -> None:
    print(line, flush=True)


def main(args: argparse.Namespace) -> int:
    from .cluster import ClusterError, down, layout_of, run_node, status, up
    from .state import DEFAULT_APISERVER_PORT

    command = args.cluster_command
    try:
        if command == "node":
            return run_node(args.dir)
        if command == "up":
            paths = None
            if args.image_path:
                paths = dict(item.split("=", 1) for item in args.image_path if "=" in item)
                if len(paths) != len(args.image_path):
                    raise ClusterError("--image-path takes IMAGE_PATH=HOST_PATH")
            up(args.name, args.port or DEFAULT_APISERVER_PORT, say, image_paths=paths)
            return 0
        if command == "down":
            down(args.name, say)
            return 0
        if command == "env":
            layout = layout_of(args.name)
            if not layout.state_file.exists():
                raise ClusterError(f"no cluster {args.name} here: specdeploy cluster up")
            say(layout.export_line())
            return 0
        return 0 if status(args.name, say) else 3
    except (ClusterError, ValueError) as err:
        print(f"specdeploy cluster {command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdeploy cluster {command}: interrupted", file=sys.stderr)
        return 130
