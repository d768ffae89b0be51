"""What can be checked of the images without a Docker engine: the essentials of each Dockerfile."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = (ROOT / name).read_text()
    logical = re.sub(r"\\\n", " ", text)
    pairs = []
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        pairs.append((word.upper(), rest.strip()))
    return pairs


def _args(pairs) -> dict[str, str]:
    out = {}
    for word, rest in pairs:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            out[key] = value
    return out


def _base_images(pairs) -> list[str]:
    args = _args(pairs)
    images = []
    for word, rest in pairs:
        if word != "FROM":
            continue
        ref = rest.split()[0]
        images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref))
    return images


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.engine"])
def test_base_images_are_pinned_to_a_version_tag(name):
    pairs = _instructions(name)
    stages = {rest.split()[-1] for word, rest in pairs if word == "FROM" and " AS " in rest.upper()}
    external = [ref for ref in _base_images(pairs) if ref not in stages]
    assert external
    for ref in external:
        repo, _, tag = ref.rpartition(":")
        assert repo and tag and tag != "latest", ref
        # A version tag carries a dotted release number (3.12.10, 12.8.1), not a floating name.
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"{name}: {ref} is not pinned to a release"


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.engine"])
def test_runs_as_a_numeric_non_root_user(name):
    users = [rest for word, rest in _instructions(name) if word == "USER"]
    assert users, f"{name} has no USER"
    final = users[-1]
    uid, _, gid = final.partition(":")
    assert uid.isdigit() and int(uid) != 0, final
    assert not gid or (gid.isdigit() and int(gid) != 0), final


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.engine"])
def test_the_user_has_a_passwd_entry_in_the_final_stage(name):
    """Found by running the built operator image (hack/run-operator-image.py): kopf names its
    peering identity with getpass.getuser(), which raises for a uid /etc/passwd does not know, so
    the operator died at start-up. The final stage writes an entry for the USER's uid."""
    pairs = _instructions(name)
    final_stage = pairs[max(i for i, (word, _) in enumerate(pairs) if word == "FROM"):]
    uid = [rest for word, rest in final_stage if word == "USER"][-1].partition(":")[0]
    runs = " ".join(rest for word, rest in final_stage if word == "RUN")
    assert re.search(rf"[a-z_][a-z0-9_-]*:x:{uid}:\d+:[^:]*:(/[^:]*):", runs), f"{name}: no passwd entry for uid {uid}"
    if name == "Dockerfile.engine":  # Triton and torch keep caches under the home directory
        home = re.search(rf":x:{uid}:\d+:[^:]*:(/[^:]*):", runs).group(1)
        assert f"chown 65532:65532 {home}" in runs and any(
            word == "ENV" and f"HOME={home}" in rest for word, rest in final_stage)


def test_the_demo_pair_is_readable_by_the_engines_user():
    """Found by running the built engine image: the demo pair trained at build time (as root) had
    model.safetensors at mode 0600, so the engine (uid 65532) could not load the pair that
    manifests/examples/tiny-cpu-demo.yaml serves."""
    runs = [rest for word, rest in _instructions("Dockerfile.engine") if word == "RUN"]
    (train,) = [r for r in runs if "ensure_models(Path('/opt/specdeploy/demo')" in r]
    assert train.rstrip().endswith("chmod -R a+rX /opt/specdeploy")


@pytest.mark.parametrize("name, entry", [
    ("Dockerfile.operator", ["operator"]),
    ("Dockerfile.engine", ["engine", "serve"]),
])
def test_runs_the_specdeploy_cli(name, entry):
    pairs = _instructions(name)
    entrypoint = [rest for word, rest in pairs if word == "ENTRYPOINT"][-1]
    cmd = [rest for word, rest in pairs if word == "CMD"][-1]
    assert entrypoint == '["specdeploy"]'
    assert cmd.startswith("[" + ", ".join(f'"{w}"' for w in entry))


def test_operator_image_installs_no_torch():
    pairs = _instructions("Dockerfile.operator")
    installs = [rest for word, rest in pairs if word == "RUN" and "pip install" in rest]
    assert installs
    for line in installs:
        assert "torch" not in line
        assert ".[engine]" not in line and ".[dev]" not in line
    assert any('".[operator]"' in line for line in installs)
    # ... and the operator extra itself pulls no torch.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.lower().startswith("torch") for dep in extras["operator"])


def test_engine_image_installs_torch_and_the_engine_and_disagg_extras():
    pairs = _instructions("Dockerfile.engine")
    installs = " ".join(rest for word, rest in pairs if word == "RUN" and "pip install" in rest)
    assert "torch==" in installs
    assert '".[engine,disagg]"' in installs  # prefill/decode roles: Mooncake's transfer engine
    assert "libibverbs1" in " ".join(rest for word, rest in pairs if word == "RUN" and "apt-get install" in rest)
    assert _base_images(pairs)[0].startswith("nvidia/cuda:")
    assert "-runtime-" in _base_images(pairs)[0]


def test_build_context_is_limited_to_what_the_images_copy():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore
    copied = set()
    for name in ("Dockerfile.operator", "Dockerfile.engine"):
        for word, rest in _instructions(name):
            if word == "COPY" and "--from" not in rest:
                copied.update(src.rstrip("/") for src in rest.split()[:-1])
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert copied <= allowed, f"copied but ignored: {copied - allowed}"
    for path in copied:
        assert (ROOT / path).exists(), path


# What the engine extra adds on top of the operator extra: none of it is in the operator image.
ENGINE_ONLY_MODULES = ["torch", "numpy", "safetensors", "tokenizers", "fastapi", "uvicorn", "prometheus_client"]

_WITHOUT_ENGINE_DEPS = f"""
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ENGINE_ONLY_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the operator image)")
        return None

sys.meta_path.insert(0, Missing())
from specdeploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["operator", "--help"], ["plan", "--help"]])
def test_operator_image_commands_run_without_the_engine_dependencies(argv, tmp_path):
    """The operator image installs only the operator extra: `specdeploy operator` (and the planner
    it shares with the engine) must start with torch & co. absent."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-P", "-c", _WITHOUT_ENGINE_DEPS, *argv],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: specdeploy" in result.stdout


def test_operator_handlers_import_without_the_engine_dependencies(tmp_path):
    import subprocess
    import sys

    code = _WITHOUT_ENGINE_DEPS.replace(
        "from specdeploy.cli import main\nsys.exit(main(sys.argv[1:]))",
        "import specdeploy.operator.handlers, specdeploy.operator.desired.planning",
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
