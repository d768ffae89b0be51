"""The layering of the code base, written down and checked (as kopf does with import-linter
contracts). Two kinds of rule, both checked over every import statement, including the ones inside
functions:

- the engine's layers, in order (import-linter's `layers` contract): a module may import from its
  own package and from the layers below it, never from a layer above it nor from a sibling of its
  own layer; an import under `if TYPE_CHECKING:` is reported apart and is allowed only where
  TYPE_ONLY_IMPORTS names it;
- contracts: a pair of module prefixes (importers, forbidden imports), for what the order does not
  say (third-party libraries, the operator, the local cluster).

Also: tests share code only through tests/support (and the testcluster package): no module under
tests/ imports a test module or changes sys.path; the packages pyproject.toml lists are exactly the
folders of the tree; nothing at the repository root can shadow the standard library's `operator`
module.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"specdeploy.engine": ROOT / "engine", "specdeploy.operator": ROOT / "operator",
           "specdeploy.localcluster": ROOT / "localcluster",
           "specdeploy": ROOT / "specdeploy"}

# The engine's layers, lowest first. A layer of several packages holds independent siblings
# (neither imports the other). specdeploy.engine itself (its __init__) belongs to no layer.
ENGINE_LAYERS = [
    ["specdeploy.engine.planner"],                   # pure Python: shapes, the plan (the operator's contract)
    ["specdeploy.engine.kernels",                    # Triton kernels behind loaders
     "specdeploy.engine.memory",                     # the KV pools and the slot table
     "specdeploy.engine.parallel"],                  # the TP group and its collectives
    ["specdeploy.engine.models"],                    # nn.Modules over the pools
    ["specdeploy.engine.speculative"],               # the algorithm as tensor functions
    ["specdeploy.engine.runtime"],                   # one process's step loop, graphs, transfer, lockstep
    ["specdeploy.engine.serving"],                   # HTTP, batching, the serve CLI
    ["specdeploy.engine.demo"],                      # the tiny pair and `specdeploy demo`
]

# (importer, imported): why a lower layer may name a higher one's type for annotations alone,
# under `if TYPE_CHECKING:` (never at run time). Empty: no layer needs one.
TYPE_ONLY_IMPORTS: dict[tuple[str, str], str] = {}

ENGINE_REST = [m for layer in ENGINE_LAYERS for m in layer if m != "specdeploy.engine.planner"]

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
     ["specdeploy.engine.planner", *(m for m in ENGINE_REST if m != "specdeploy.engine.demo")],
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


@dataclass(frozen=True)
class Import:
    name: str        # the module imported, or module.name for each name of a `from` import
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_in(module: str, source: str, is_package: bool = False, filename: str = "<module>") -> list[Import]:
    """Every import statement of a module's source, at any depth (functions, classes, branches),
    relative ones resolved against `module`."""
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append(Import(name, node.lineno, type_only))
            found.extend(Import(f"{name}.{alias.name}", node.lineno, type_only) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source, filename), False)
    return found


def imports_of(module: str, path: Path) -> list[Import]:
    return imports_in(module, path.read_text(), path.name == "__init__.py", str(path))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> tuple[int, str] | None:
    """(index in ENGINE_LAYERS, package) of an engine module, or None outside the layers."""
    for index, layer in enumerate(ENGINE_LAYERS):
        for package in layer:
            if under(name, package):
                return index, package
    return None


def layer_breaks(imports: dict[str, list[Import]]) -> tuple[list[str], list[str]]:
    """-> (imports that run upward or sideways, type-only ones of that kind not in TYPE_ONLY_IMPORTS)."""
    upward, type_only = [], []
    for module, found in imports.items():
        here = layer_of(module)
        if here is None:
            continue
        for imp in found:
            there = layer_of(imp.name)
            if there is None or there[1] == here[1] or there[0] < here[0]:
                continue
            way = "up" if there[0] > here[0] else "sideways"
            text = f"{module}:{imp.line} imports {imp.name} ({way}: {here[1]} -> {there[1]})"
            if not imp.type_only:
                upward.append(text)
            elif (module, there[1]) not in TYPE_ONLY_IMPORTS:
                type_only.append(text)
    return sorted(upward), sorted(type_only)


MODULES = module_files()
IMPORT_STATEMENTS = {m: imports_of(m, p) for m, p in MODULES.items()}
IMPORTS = {m: {imp.name for imp in found} for m, found in IMPORT_STATEMENTS.items()}


def test_engine_layers_in_order():
    upward, type_only = layer_breaks(IMPORT_STATEMENTS)
    assert not upward, "imports against the order of ENGINE_LAYERS:\n  " + "\n  ".join(upward)
    assert not type_only, ("type-only imports against the order of ENGINE_LAYERS that TYPE_ONLY_IMPORTS does not name:\n  "
                           + "\n  ".join(type_only))


def test_every_engine_package_has_a_layer():
    """A new package under engine/ gets a place in the order before it can be imported."""
    packages = {".".join(m.split(".")[:3]) for m in MODULES if m.startswith("specdeploy.engine.")}
    assert sorted(p for p in packages if layer_of(p) is None) == []


def test_layer_check_can_fail():
    """The check sees an upward import inside a function, a relative one, a sideways one, and
    tells a type-only import apart (a check that cannot fail is no check)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from specdeploy.engine.planner.shapes import ModelShapes\n"        # downward: fine
        "from .layers import argmax\n"                                       # own package: fine
        "if TYPE_CHECKING:\n"
        "    from specdeploy.engine.serving.scheduler import Scheduler\n"
        "else:\n"
        "    from ..kernels import attention_ops\n"                          # downward: fine
        "def step():\n"
        "    from ..runtime import runner\n"                                 # upward, relative, in a function
        "    return runner\n"
    )
    planted = {"specdeploy.engine.models.planted": imports_in("specdeploy.engine.models.planted", source),
               "specdeploy.engine.memory.planted": imports_in("specdeploy.engine.memory.planted",
                                                              "import specdeploy.engine.parallel\n")}
    upward, type_only = layer_breaks(planted)
    assert upward == [
        "specdeploy.engine.memory.planted:1 imports specdeploy.engine.parallel "
        "(sideways: specdeploy.engine.memory -> specdeploy.engine.parallel)",
        "specdeploy.engine.models.planted:9 imports specdeploy.engine.runtime "
        "(up: specdeploy.engine.models -> specdeploy.engine.runtime)",
        "specdeploy.engine.models.planted:9 imports specdeploy.engine.runtime.runner "
        "(up: specdeploy.engine.models -> specdeploy.engine.runtime)",
    ]
    assert type_only == [
        "specdeploy.engine.models.planted:5 imports specdeploy.engine.serving.scheduler "
        "(up: specdeploy.engine.models -> specdeploy.engine.serving)",
        "specdeploy.engine.models.planted:5 imports specdeploy.engine.serving.scheduler.Scheduler "
        "(up: specdeploy.engine.models -> specdeploy.engine.serving)",
    ]


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


# Tests share code through these folders only (pyproject.toml puts them on pytest's pythonpath):
# a helper is imported by its own name, never through `tests.` or a test folder put on sys.path.
TESTS = ROOT / "tests"
TEST_SUPPORT = [TESTS / "support", TESTS / "cluster" / "testcluster"]
PATH_CALLS = {"insert", "append", "extend"}


def modules_of_test_folders() -> dict[Path, str]:
    """Every module under tests/ but the shared ones -> its source."""
    return {path: path.read_text() for path in sorted(TESTS.rglob("*.py"))
            if not any(path.is_relative_to(folder) for folder in TEST_SUPPORT)}


def shared_code_breaks(sources: dict[Path, str], test_modules: set[str]) -> list[str]:
    """Where a module under tests/ imports a test module (by `tests.`, by a test folder's module
    name, or loaded from its file) or changes sys.path."""
    broken = []
    for path, source in sources.items():
        where = path.relative_to(TESTS)
        module = ".".join(["tests", *where.with_suffix("").parts])
        tree = ast.parse(source, str(path))
        for imp in imports_in(module, source, path.name == "__init__.py", str(path)):
            top = imp.name.split(".")[0]
            if top == "tests" or top in test_modules:
                broken.append(f"{where}:{imp.line} imports {imp.name}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            func = node.func
            if (func.attr in PATH_CALLS and isinstance(func.value, ast.Attribute) and func.value.attr == "path"
                    and isinstance(func.value.value, ast.Name) and func.value.value.id == "sys"):
                broken.append(f"{where}:{node.lineno} calls sys.path.{func.attr}")
            elif func.attr == "spec_from_file_location":
                named = [c.value for arg in node.args for c in ast.walk(arg)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.endswith(".py")]
                broken.extend(f"{where}:{node.lineno} loads {n}" for n in named if Path(n).stem in test_modules)
    return sorted(broken)


def test_tests_share_code_only_through_support():
    """No test imports another test module or puts a folder on sys.path: what tests share lives
    in tests/support (or the testcluster package) and is imported by its own name."""
    sources = modules_of_test_folders()
    broken = shared_code_breaks(sources | {p: p.read_text() for folder in TEST_SUPPORT for p in folder.rglob("*.py")},
                                {p.stem for p in sources})
    assert not broken, "move what is shared to tests/support:\n  " + "\n  ".join(broken)


def test_test_module_check_can_fail():
    """A planted test module that reaches into other test modules three ways is reported each time."""
    planted = TESTS / "engine" / "planted.py"
    source = (
        "import sys\n"
        "from tests.engine.serving.conftest import serve_argv\n"
        "import importlib.util\n"
        "def f():\n"
        "    sys.path.insert(0, 'tests/engine/models')\n"
        "    from test_prefix_cache import check_accounting\n"
        "    importlib.util.spec_from_file_location('m', 'tests/operator/test_engine_pod.py')\n"
        "    from v4_tiny import TINY\n"                                   # a support module: fine
    )
    assert shared_code_breaks({planted: source}, {"conftest", "test_prefix_cache", "test_engine_pod"}) == [
        "engine/planted.py:2 imports tests.engine.serving.conftest",
        "engine/planted.py:2 imports tests.engine.serving.conftest.serve_argv",
        "engine/planted.py:5 calls sys.path.insert",
        "engine/planted.py:6 imports test_prefix_cache",
        "engine/planted.py:6 imports test_prefix_cache.check_accounting",
        "engine/planted.py:7 loads tests/operator/test_engine_pod.py",
    ]


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
