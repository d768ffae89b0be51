"""The `specdeploy` command line: one entry point, one subcommand per job.

`pip install specdeploy` alone (no extras) must give a working `specdeploy plan`, so building the
parser imports only the standard library: each subcommand's `add_parser` lives in a module whose
top level imports argparse and stdlib modules only (tests/specdeploy/test_cli.py holds every one
of them to that), and the heavy imports (torch, kopf, httpx, ...) happen inside the function that runs it.

A subcommand whose extra is not installed stops before that function runs: exit code 2 and one
line naming the extra. The extra's packages are read from this distribution's own metadata (the
optional-dependencies of pyproject.toml), so the list has one home.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import sys

DISTRIBUTION = "specdeploy"
# (module holding add_parser, the extra its run needs; None: the standard library is enough)
SUBCOMMANDS: tuple[tuple[str, str | None], ...] = (
    ("specdeploy.engine.planner.cli", None),
    ("specdeploy.engine.serving.cli", "engine"),
    ("specdeploy.engine.serving.disagg.cli", "engine"),
    ("specdeploy.localcluster.demo", "engine"),
    ("specdeploy.operator.cli", "operator"),
    ("specdeploy.localcluster.cli", "cluster"),
)
_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run from a source tree)"


def plan_resource(args: argparse.Namespace) -> int:
    """`specdeploy plan -f`: the operator's planning of a resource file (the planner's CLI has
    the flags; the operator package, which it may not import, does the work)."""
    from specdeploy.operator import plan_file

    return plan_file.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdeploy", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module, extra in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub).set_defaults(_extra=extra)
    sub.choices["plan"].set_defaults(plan_resource=plan_resource)
    return parser


def extra_requirements(extra: str) -> list[str] | None:
    """Distribution names the extra `extra` requires, from the installed metadata; None when
    this package is not installed (run from a source tree), so nothing can be checked."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    names = []
    for req in requires:
        spec, _, marker = req.partition(";")
        if extra not in _EXTRA_MARKER.findall(marker):
            continue
        name = _REQUIREMENT_NAME.match(spec)
        if name and name.group(1).lower() != DISTRIBUTION:
            names.append(name.group(1))
    return names


def missing_requirements(extra: str) -> list[str]:
    missing = []
    for name in extra_requirements(extra) or ():
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    extra = getattr(args, "_extra", None)
    if extra is not None:
        missing = missing_requirements(extra)
        if missing:
            command = " ".join(filter(None, (args.command, getattr(args, "engine_command", None))))
            print(f"specdeploy {command}: needs the {extra} extra ({', '.join(missing)} not installed): "
                  f"pip install '{DISTRIBUTION}[{extra}]'", file=sys.stderr)
            return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # `specdeploy plan ... | head`: the reader left; what it did not read is not an error.
        # stdout is pointed at /dev/null so that the interpreter's own flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
