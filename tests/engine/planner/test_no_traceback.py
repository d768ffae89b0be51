"""No config.json makes the planner print a traceback: every field of every test and shipped
config, removed or given a value of the wrong kind, either still plans or is refused by
`specdeploy plan` with exit code 2 and one line naming the field; the operator turns the same into
PlanningError(ConfigInvalid) with that line, never its catch-all for a crash."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
from pathlib import Path

import pytest

from specdeploy.engine.planner import cli
from specdeploy.engine.planner.errors import PLANNER_FAILED

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "tests" / "configs").glob("*.json"))
HEADS = {"eagle3-llama3.1-instruct-8b": "EAGLE3", "eagle-llama3.1-instruct-8b": "EAGLE"}
HEAD_TARGET = ROOT / "tests" / "configs" / "llama-3.1-8b-instruct.json"
BAD_VALUES = [None, "x", -1, 1e30, {}, [1, 2]]
# The operator runs the same planner functions: fewer variants suffice to see its wrapping.
OPERATOR_BAD_VALUES = ["x", 1e30, {}]


def _mutations(config: dict, bad_values=BAD_VALUES):
    """(label, mutated config) for each field and nested field: removed, and each bad value."""
    def paths(node, prefix=()):
        for key, value in node.items():
            yield (*prefix, key)
            if isinstance(value, dict):
                yield from paths(value, (*prefix, key))

    for path in paths(config):
        variants = [("removed", None)] + [(repr(v), v) for v in bad_values]
        for label, value in variants:
            mutated = copy.deepcopy(config)
            node = mutated
            for key in path[:-1]:
                node = node[key]
            if label == "removed":
                del node[path[-1]]
            else:
                node[path[-1]] = value
            yield f"{'.'.join(path)}={label}", mutated


def _plan_argv(name: str, config_file: Path) -> list[str]:
    if name in HEADS:
        return ["--target", str(HEAD_TARGET), "--draft", str(config_file), "--algorithm", HEADS[name]]
    if json.loads(config_file.read_text()).get("num_nextn_predict_layers") or name.startswith("deepseek"):
        return ["--target", str(config_file), "--algorithm", "MTP", "--steps", "1"]
    return ["--target", str(config_file), "--algorithm", "NONE"]


def _run_plan(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv, "--json"])
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = args.func(args)
    return rc, err.getvalue()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_field_broken_plans_or_is_refused_in_one_line(path, tmp_path):
    config = json.loads(path.read_text())
    file = tmp_path / "config.json"
    crashes, refused = [], 0
    for label, mutated in _mutations(config):
        file.write_text(json.dumps(mutated))
        try:
            rc, err = _run_plan(_plan_argv(path.stem, file))
        except Exception as exc:  # noqa: BLE001 - any escape is what this test looks for
            crashes.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        if rc == 2:
            refused += 1
            lines = err.strip().splitlines()
            if len(lines) != 1 or not lines[0].startswith("specdeploy plan: "):
                crashes.append(f"{label}: not one line: {err!r}")
            elif PLANNER_FAILED in lines[0]:   # refused, but by the last-resort catch
                crashes.append(f"{label}: {lines[0]}")
        elif rc != 0:
            crashes.append(f"{label}: exit {rc}")
    assert not crashes, f"{len(crashes)} broken configs escape the planner:\n" + "\n".join(crashes[:40])
    assert refused > 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_operator_refuses_the_same_as_config_invalid(path):
    from specdeploy.operator.desired.planning import PlanningError, plan_engine

    config = json.loads(path.read_text())
    head = path.stem in HEADS
    target_config = json.loads(HEAD_TARGET.read_text()) if head else None
    if head:
        algorithm = HEADS[path.stem]
        speculative = {"algorithm": algorithm, "numSteps": 3, "topk": 1, "numDraftTokens": 4}
    elif config.get("num_nextn_predict_layers") or path.stem.startswith("deepseek"):
        speculative = {"algorithm": "MTP", "numSteps": 1, "topk": 1, "numDraftTokens": 2}
    else:
        speculative = {"algorithm": "NONE"}
    spec = {"target": {"model": "t"}, "speculative": speculative, "gpu": {"product": "h200"},
            "engine": {"maxRunningRequests": 8, "contextLength": 4096}}
    if head:
        spec["draft"] = {"model": "d"}
    crashes, refused = [], 0
    for label, mutated in _mutations(config, OPERATOR_BAD_VALUES):
        try:
            if head:
                plan_engine(spec, target_config, mutated)
            else:
                plan_engine(spec, mutated, None)
        except PlanningError as err:
            refused += err.reason == "ConfigInvalid"
            if err.reason == "ConfigInvalid" and PLANNER_FAILED in err.message:
                crashes.append(f"{label}: {err.message}")
        except Exception as exc:  # noqa: BLE001
            crashes.append(f"{label}: {type(exc).__name__}: {exc}")
    assert not crashes, f"{len(crashes)} broken configs crash the planner under the operator:\n" + "\n".join(crashes[:40])
    assert refused > 0


def _example_cases():
    """(example, role) for every config written inline in manifests/examples."""
    import yaml

    for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml")):
        sdd = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "SpecDecodeDeployment")
        for role in ("target", "draft"):
            if "config" in sdd["spec"].get(role, {}):
                yield pytest.param(path, role, id=f"{path.stem}-{role}")


@pytest.mark.parametrize(("example", "role"), list(_example_cases()))
def test_example_inline_configs_broken_are_config_invalid(example, role):
    """The examples' inline configs, broken field by field under their own spec, as the operator
    sees them (the same planner functions the CLI test above holds to one-line refusals)."""
    import yaml

    from specdeploy.operator.desired.planning import PlanningError, plan_engine

    text = example.read_text()
    spec = next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "SpecDecodeDeployment")["spec"]
    configs = {}
    for r in ("target", "draft"):
        part = spec.get(r)
        if part is None:
            configs[r] = None
        elif "config" in part:
            configs[r] = part["config"]
        else:   # named in the comment: `#   target config.json:   manifests/models/.../config.json`
            line = next(line for line in text.splitlines() if line.lstrip("# ").startswith(f"{r} config.json:"))
            configs[r] = json.loads((ROOT / line.split(":", 1)[1].strip()).read_text())
    crashes, refused = [], 0
    for label, mutated in _mutations(configs[role], OPERATOR_BAD_VALUES):
        pair = {**configs, role: mutated}
        try:
            plan_engine(spec, pair["target"], pair["draft"])
        except PlanningError as err:
            refused += err.reason == "ConfigInvalid"
            if PLANNER_FAILED in err.message:
                crashes.append(f"{label}: {err.message}")
        except Exception as exc:  # noqa: BLE001
            crashes.append(f"{label}: {type(exc).__name__}: {exc}")
    assert not crashes, "\n".join(crashes[:40])
    assert refused > 0
