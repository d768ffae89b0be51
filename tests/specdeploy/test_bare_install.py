"""`pip install specdeploy` alone, as a new user gets it: a wheel of this tree installed into a
fresh virtual environment without site packages, run from outside the repository. `specdeploy
plan` must work there on every shipped config (manifests/models/*, manifests/examples/*) with the
standard library only, and the subcommands that need an extra must say which, in one line.

The wheel is built once per source state (`pip wheel --no-deps --no-build-isolation`: offline,
the dev extra brings setuptools) into ~/.cache/specdeploy/bare-install/<hash of the sources>, so
a second run only makes the venv (well under a second) and installs the wheel.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "manifests" / "models"
EXAMPLES = ROOT / "manifests" / "examples"
# What goes into the wheel (pyproject's packages and package-dir, plus the readme it names).
SOURCES = ("pyproject.toml", "README.md", "specdeploy", "engine", "operator", "localcluster")
PLAN_KEYS = ("tensor_parallel_size", "spec_hidden_size", "draft_input_hidden_size", "max_total_tokens",
             "required_tokens", "memory_per_gpu.weight_bytes", "memory_per_gpu.kv_cache_bytes_per_token")


def _source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        else:
            files += sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specdeploy" / "bare-install"


def _wheel(tmp: Path) -> Path:
    """The wheel of the current sources: from the cache, else built from a copy of them (a build
    in the tree would leave build/ behind, and stale files there end up in later wheels)."""
    files = _source_files()
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    out = _cache_dir() / digest.hexdigest()[:16]
    found = sorted(out.glob("specdeploy-*.whl"))
    if found:
        return found[0]
    src = tmp / "src"
    for f in files:
        dest = src / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    building = tmp / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(building), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = building.glob("specdeploy-*.whl")
    for old in _cache_dir().glob("*"):   # wheels of source states a week old are not coming back
        if old.is_dir() and time.time() - old.stat().st_mtime > 7 * 86400:
            shutil.rmtree(old, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, out / (wheel.name + ".part"))
    (out / (wheel.name + ".part")).rename(out / wheel.name)  # complete or absent, never half
    return out / wheel.name


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONNOUSERSITE"] = "1"  # nothing from ~/.local either
    return env


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """(the venv's `specdeploy` console script, a working directory outside the repository)."""
    tmp = tmp_path_factory.mktemp("bare")
    try:
        wheel = _wheel(tmp)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"pip wheel failed (is the dev extra installed? it brings setuptools):\n{err.stderr}")
    venv = tmp / "venv"
    # Without pip (it is not what is tested, and ensurepip takes seconds): this pip installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, capture_output=True, text=True)
    work = tmp / "work"
    work.mkdir()
    # The environment really is bare: none of the extras' packages can be imported there.
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, json; print(json.dumps([m for m in "
         "('torch', 'httpx', 'kopf', 'yaml', 'fastapi', 'numpy', 'safetensors') if u.find_spec(m)]))"],
        cwd=work, env=_clean_env(), capture_output=True, text=True, check=True)
    assert json.loads(probe.stdout) == [], f"the fresh venv sees packages it should not: {probe.stdout}"
    return venv / "bin" / "specdeploy", work


def _run(bare, *args: str) -> subprocess.CompletedProcess:
    script, work = bare
    return subprocess.run([str(script), *map(str, args)], cwd=work, env=_clean_env(),
                          capture_output=True, text=True, timeout=60)


def _model_dirs() -> list[Path]:
    return sorted(p for p in MODELS.iterdir() if (p / "config.json").is_file())


# The heads in manifests/models and the targets they were trained for.
HEAD_TARGETS = {
    "eagle3-llama3.1-instruct-8b": ("EAGLE3", "llama-3.1-8b-instruct"),
    "eagle-llama3.1-instruct-8b": ("EAGLE", "llama-3.1-8b-instruct"),
    "eagle3-llama3.3-instruct-70b": ("EAGLE3", "llama-3.3-70b-instruct"),
}


@pytest.mark.parametrize("model", _model_dirs(), ids=lambda p: p.name)
def test_plan_every_shipped_model_config(bare, model):
    config = json.loads((model / "config.json").read_text())
    if model.name in HEAD_TARGETS:
        algorithm, target = HEAD_TARGETS[model.name]
        args = ["--target", MODELS / target / "config.json", "--draft", model / "config.json", "--algorithm", algorithm]
    elif config.get("num_nextn_predict_layers"):
        args = ["--target", model / "config.json", "--algorithm", "MTP", "--steps", "1"]
    else:
        args = ["--target", model, "--algorithm", "NONE"]   # the directory form of PATH
    result = _run(bare, "plan", *args, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["max_total_tokens"] >= plan["required_tokens"] > 0
    if model.name == "llama-3.1-8b-instruct":   # the human table once
        table = _run(bare, "plan", *args)
        assert table.returncode == 0 and "max_total_tokens" in table.stdout, table.stderr


def test_every_shipped_head_is_covered():
    """manifests/models/README.md says which folders are drafts; each one is planned above."""
    rows = [line.split("|") for line in (MODELS / "README.md").read_text().splitlines() if line.startswith("| `")]
    drafts = {row[1].strip().strip("`") for row in rows if "draft" in row[3]}
    assert drafts and drafts == HEAD_TARGETS.keys()


def _example_args(path: Path, tmp: Path) -> list[str]:
    """The `specdeploy plan` flags that plan what the example's resource asks for."""
    text = path.read_text()
    spec = next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "SpecDecodeDeployment")["spec"]
    named = {}
    for line in text.splitlines():   # `#   target config.json:   manifests/models/.../config.json`
        parts = line.lstrip("# ").split(":")
        if len(parts) == 2 and parts[0].endswith(" config.json"):
            named[parts[0].split()[0]] = ROOT / parts[1].strip()
    args = []
    for role in ("target", "draft"):
        if role not in spec:
            continue
        if "config" in spec[role]:
            file = tmp / f"{path.stem}-{role}.json"
            file.write_text(json.dumps(spec[role]["config"]))
        else:
            file = named[role]
        args += [f"--{role}", file]
    spec_dec, engine = spec["speculative"], spec.get("engine", {})
    args += ["--algorithm", spec_dec["algorithm"]]
    if spec_dec["algorithm"] != "NONE":
        args += ["--steps", spec_dec["numSteps"], "--topk", spec_dec["topk"], "--draft-tokens", spec_dec["numDraftTokens"]]
    args += ["--max-running-requests", engine["maxRunningRequests"], "--context-length", engine["contextLength"]]
    if "cpu" in spec:
        args += ["--gpu-memory-gib", spec["cpu"]["memoryGiB"], "--gpus-per-node", 1]
    else:
        gpu = spec["gpu"]
        args += ["--gpu-memory-gib", gpu["memoryGiB"]] if gpu.get("memoryGiB") else ["--gpu", gpu["product"]]
        args += ["--gpus-per-node", gpu.get("perNode", 8)]
        if gpu.get("maxNodes", 1) > 1:
            args += ["--max-nodes", gpu["maxNodes"]]
    return args


def _commented_plan(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.lstrip("# ").split(":")
        if len(parts) == 2 and parts[0].strip() in PLAN_KEYS:
            out[parts[0].strip()] = int(parts[1])
    return out


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_plan_every_example_as_its_comment_says(bare, example, tmp_path):
    """The console script of the bare install plans each example exactly as the example's own
    comment states (the operator's plan, tests/chart/test_examples.py)."""
    result = _run(bare, "plan", *_example_args(example, tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    got = {}
    for key in PLAN_KEYS:
        value = plan
        for part in key.split("."):
            value = value[part]
        got[key] = value
    assert got == _commented_plan(example)


@pytest.mark.parametrize(("argv", "extra"), [
    (["operator"], "operator"),
    (["engine", "serve", "--target", "meta-llama/Llama-3.1-8B-Instruct"], "engine"),
    (["demo"], "engine"),
    (["cluster", "up"], "cluster"),
])
def test_subcommands_name_the_extra_they_need(bare, argv, extra):
    result = _run(bare, *argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"pip install 'specdeploy[{extra}]'" in lines[0]
    assert result.stdout == ""


def test_help_lists_every_subcommand(bare):
    result = _run(bare, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("plan", "engine", "demo", "operator", "cluster"):
        assert command in result.stdout


def test_bad_config_is_one_line_and_exit_2(bare, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    result = _run(bare, "plan", "--target", tmp_path / "config.json", "--algorithm", "NONE")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
