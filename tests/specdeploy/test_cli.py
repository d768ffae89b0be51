"""specdeploy/cli.py in the development install: building the parser imports the standard
library only (each subcommand's add_parser module), and the extras are read from the installed
metadata. The bare install itself is tests/specdeploy/test_bare_install.py."""

import json
import subprocess
import sys

import pytest

from specdeploy import cli


def test_building_the_parser_imports_only_the_standard_library():
    probe = ("import sys, json; from specdeploy.cli import build_parser; build_parser(); "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True)
    third_party = set(json.loads(out.stdout)) - {"specdeploy", "__main__", "_distutils_hack"}
    # the editable install's own finder module is setuptools' machinery, not a dependency
    assert {m for m in third_party if not m.startswith("__editable__")} == set()


def test_every_subcommand_names_an_extra_declared_in_pyproject():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for module, extra in cli.SUBCOMMANDS:
        assert extra is None or extra in extras, (module, extra)
        if extra is not None:
            declared = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in extras[extra]}
            assert {n.lower() for n in cli.extra_requirements(extra)} == declared
    assert cli.missing_requirements("engine") == [] and cli.missing_requirements("operator") == []
