"""The layering of the code base, written down and checked (as kopf does with import-linter
contracts; a contract here is a pair of module prefixes, checked over every import statement,
including the ones inside functions).

Also: the packages pyproject.toml lists are exactly the folders of the tree, and nothing at the
repository root can shadow the standard library's `operator` module.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"specdeploy.engine": ROOT / "engine", "specdeploy.operator": ROOT / "operator",
           "specdeploy.localcluster": ROOT / "localcluster",
           "specdeploy": ROOT / "specdeploy"}

ENGINE_REST = ["specdeploy.engine.models", "specdeploy.engine.kernels", "specdeploy.engine.speculative",
               "specdeploy.engine.runtime", "specdeploy.engine.serving", "specdeploy.engine.demo"]

# (why, importers, forbidden imports): a module under an importer prefix may import nothing under a
# forbidden prefix.
CONTRACTS = [
    ("the planner is pure Python (the operator imports it; `pip install specdeploy` alone plans)",
     ["specdeploy.engine.planner"],
     ["torch", "triton", "numpy", "safetensors", "httpx", "kopf", "kubernetes", "yaml", "specdeploy.operator", *ENGINE_REST]),
    ("only engine.kernels imports triton",
     ["specdeploy.engine.planner", *(m for m in ENGINE_REST if m != "specdeploy.engine.kernels"),
      "specdeploy.operator", "specdeploy.cli"], ["triton"]),
    ("serving never reaches into the kernels", ["specdeploy.engine.serving"], ["specdeploy.engine.kernels"]),
    ("demo code is never imported by the engine proper",
     ["specdeploy.engine.planner", "specdeploy.engine.models", "specdeploy.engine.kernels",
      "specdeploy.engine.speculative", "specdeploy.engine.runtime", "specdeploy.engine.serving"],
     ["specdeploy.engine.demo"]),
    ("the operator's desired state is pure", ["specdeploy.operator.desired", "specdeploy.operator.api"],
     ["kopf", "kubernetes", "httpx", "specdeploy.operator.cluster", "specdeploy.operator.handlers"]),
    ("only the handlers and the operator CLI import kopf", ["specdeploy.operator.cluster"], ["kopf"]),
    ("the operator uses only the engine's planner (its image has no torch)", ["specdeploy.operator"],
     ["torch", *ENGINE_REST]),
    ("the local cluster runs the engine and the operator as processes; neither imports it",
     ["specdeploy.engine", "specdeploy.operator"], ["specdeploy.localcluster"]),
    ("what a pod spec means on a local node is pure", ["specdeploy.localcluster.podspec"],
     ["kubernetes", "httpx", "subprocess", "socket", "specdeploy.localcluster.kubelet"]),
]


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(module: str, path: Path) -> set[str]:
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = module_files()
IMPORTS = {m: imports_of(m, p) for m, p in MODULES.items()}


@pytest.mark.parametrize("why,importers,forbidden", CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_contract(why, importers, forbidden):
    broken = sorted(
        f"{m} imports {name}"
        for m, names in IMPORTS.items() if any(under(m, i) for i in importers)
        for name in names if any(under(name, f) for f in forbidden)
    )
    assert not broken, f"{why}:\n  " + "\n  ".join(broken)


def test_contracts_can_fail():
    """The checker sees function-level and relative imports (a contract that cannot fail is no check)."""
    src = ROOT / "engine" / "planner" / "plan.py"
    assert any(under(n, "specdeploy.engine.planner.shapes") for n in IMPORTS["specdeploy.engine.planner.plan"])
    assert "specdeploy.engine.kernels.elementwise" in IMPORTS["specdeploy.engine.kernels"]  # a lazy import
    assert src.exists()


def test_pyproject_lists_every_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    tree = {m.rsplit(".", 1)[0] if not p.name == "__init__.py" else m for m, p in MODULES.items()}
    tree |= {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert tree == listed, f"pyproject.toml [tool.setuptools].packages differs from the tree: missing {sorted(tree - listed)}, extra {sorted(listed - tree)}"


def test_nothing_at_the_root_shadows_the_standard_library():
    """A `python -m ...` run from the repository root puts the root first on sys.path: a regular
    package there named like a standard-library module (operator/ was one) breaks pip itself."""
    shadowing = sorted(
        p.name for p in ROOT.iterdir()
        if p.name in sys.stdlib_module_names and ((p / "__init__.py").exists() or p.suffix == ".py")
    )
    assert not shadowing
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_ruff_is_clean():
    """The linter's configuration lives in pyproject.toml; the tree passes it."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
