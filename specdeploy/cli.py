"""The `specdeploy` command line: one entry point, one subcommand per job.

Subcommands register themselves lazily so that `specdeploy plan` never imports torch or kopf.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdeploy", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from specdeploy.engine.planner import cli as plan_cli

    plan_cli.add_parser(sub)
    from specdeploy.engine.serving import cli as serve_cli

    serve_cli.add_parser(sub)
    from specdeploy.engine.demo import cli as demo

    demo.add_parser(sub)
    from specdeploy.operator import cli as operator_cli

    operator_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
