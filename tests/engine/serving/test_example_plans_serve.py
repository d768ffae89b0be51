"""The example SpecDecodeDeployments (manifests/examples) deploy plans the engine accepts.

For each example the operator's planner plans it (DeepSeek-V4-Flash from the local test hub's
real-format index and safetensors headers, as the operator reads a hub in a cluster; the others
from the config.json their comment names, or inline), the operator renders the engine's
Deployment and ConfigMap, and `specdeploy engine serve` takes the rendered container's command
line as it stands: its parser, its argument checks, the plan.json read back (no argument
disagrees with it: the engine would warn and take the plan's value) and what it refuses of a plan
for that target before loading a weight. No weights are loaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from chartkit import EXAMPLES, example_files, load_sdd, model_configs
from checkpoint_hub import CheckpointHub, Repo, deepseek_v4_flash_tensors, sharded_checkpoint

from specdeploy.cli import build_parser
from specdeploy.engine.serving import boot
from specdeploy.engine.serving import cli as serve_cli
from specdeploy.operator.cluster import config_source as cs
from specdeploy.operator.desired import render
from specdeploy.operator.desired.planning import ModelWeights, plan_engine


V4_EXAMPLE = EXAMPLES / "deepseek-v4-mtp.yaml"


@pytest.fixture(scope="module")
def hub():
    v4, _ = model_configs(V4_EXAMPLE)
    files = sharded_checkpoint(deepseek_v4_flash_tensors(v4), per_shard=6)
    server = CheckpointHub({load_sdd(V4_EXAMPLE)["spec"]["target"]["model"]:
                            Repo({"config.json": json.dumps(v4).encode(), **files})})
    yield server
    server.close()


def applied(path: Path) -> dict:
    """The example as the API server hands it to the operator (a namespace and a uid)."""
    sdd = load_sdd(path)
    sdd["metadata"] = {**sdd["metadata"], "namespace": "default", "uid": "0f1e2d3c-0000-4000-8000-000000000001"}
    return sdd


def engine_command(children: render.Children, tmp_path: Path) -> list[str]:
    """The engine container's command line, its plan.json where the ConfigMap would be mounted."""
    (container,) = [c for c in children.deployment["spec"]["template"]["spec"]["containers"]
                    if c["name"] == render.ENGINE_CONTAINER]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(children.config_map["data"]["plan.json"])
    return container["command"][1:] + [str(plan_file) if a == render.PLAN_PATH else a for a in container["args"]]


def accepts(command: list[str], target_config: dict, caplog):
    """What `specdeploy engine serve` checks before it loads a weight; -> the plan it serves."""
    args = build_parser().parse_args(command)
    assert args.func is serve_cli.run
    serve_cli.check_args(args)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=boot.log.name):
        plan = boot.make_plan(args, Path(args.target), None, "cuda")
    disagreements = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not disagreements, disagreements
    boot.check_plan_for_target(plan, target_config)
    return args, plan


def test_deepseek_v4_example_from_the_hubs_headers(hub, tmp_path, caplog):
    sdd = applied(V4_EXAMPLE)
    spec = sdd["spec"]
    v4, _ = model_configs(V4_EXAMPLE)
    weights = cs.resolve_model_weights(spec["target"], "spec.target", hub_endpoint=hub.url, hub_token=None)
    planned = plan_engine(spec, v4, None, ModelWeights(weights))
    assert planned.plan["target"]["weight_source"] == "headers"
    children = render.render_children(sdd, planned, render.EngineDefaults("specdeploy-engine:test", hub.url))
    args, plan = accepts(engine_command(children, tmp_path), v4, caplog)
    assert plan.to_dict() == planned.plan
    assert boot.check_plan_for_target(plan, v4)  # served as DeepSeek-V4
    # MTP from the target's own checkpoint (no --draft), expert-parallel at the plan's TP 2
    assert args.draft is None and (plan.algorithm, plan.tensor_parallel_size) == ("MTP", 2)
    assert plan.spec_hidden_size == plan.draft_input_hidden_size == 4 * plan.target.hidden_size


@pytest.mark.parametrize("path", [p for p in example_files() if p != V4_EXAMPLE], ids=lambda p: p.name)
def test_every_other_example(path, tmp_path, caplog):
    sdd = applied(path)
    target, draft = model_configs(path)
    planned = plan_engine(sdd["spec"], target, draft)
    children = render.render_children(sdd, planned, render.EngineDefaults("specdeploy-engine:test", "http://hub"))
    _, plan = accepts(engine_command(children, tmp_path), target, caplog)
    assert plan.to_dict() == planned.plan


def test_a_plan_the_engine_refuses_is_refused_before_loading(hub, tmp_path, caplog):
    """The check is not vacuous: the V4 plan with another draft algorithm is refused by name
    (planner.check_servable, the check the operator's plan passed)."""
    sdd = applied(V4_EXAMPLE)
    v4, _ = model_configs(V4_EXAMPLE)
    planned = plan_engine(sdd["spec"], v4, None)
    children = render.render_children(sdd, planned, render.EngineDefaults("specdeploy-engine:test", hub.url))
    args, plan = accepts(engine_command(children, tmp_path), v4, caplog)
    eagle = type(plan).from_dict({**plan.to_dict(), "algorithm": "EAGLE"})
    with pytest.raises(ValueError, match="its own MTP layer"):
        boot.check_plan_for_target(eagle, v4)

