"""The example SpecDecodeDeployments in manifests/examples: each one's comment says what the
operator plans for it; these tests recompute that with the operator's own planner.

After a planner change, `python3 tests/chart/test_examples.py --update` rewrites the numbers.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml

from chartkit import (
    EXAMPLES,
    OPTIONAL_PLAN_KEYS,
    PLAN_KEYS,
    ROOT,
    commented_plan,
    config_sources,
    example_files,
    load_sdd,
    model_configs,
    operator_plan,
    plan_value,
)

@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_example_is_one_namespaceless_sdd(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    sdds = [d for d in docs if d["kind"] == "SpecDecodeDeployment"]
    assert len(sdds) == 1
    assert sdds[0]["apiVersion"] == "specdeploy.dev/v1alpha1"
    # Users pick the namespace with `kubectl apply -n`.
    assert all("namespace" not in d["metadata"] for d in docs)


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_config_files_named_in_comments_exist(path):
    for role, file in config_sources(path).items():
        assert file.is_file(), f"{path.name}: {role} config {file} does not exist"


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_plan_comment_is_what_the_operator_plans(path):
    commented = commented_plan(path)
    assert PLAN_KEYS <= set(commented) <= PLAN_KEYS | OPTIONAL_PLAN_KEYS, (
        f"{path.name}: the plan comment must give exactly {sorted(PLAN_KEYS)} (and may give {sorted(OPTIONAL_PLAN_KEYS)})")
    plan = operator_plan(path)
    actual = {key: plan_value(plan, key) for key in commented}
    assert commented == actual, (
        f"{path.name}: the plan comment is stale; run `python3 tests/chart/test_examples.py --update`"
    )


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_plan_file_reproduces_the_comment(path, capsys):
    """`specdeploy plan -f EXAMPLE` (the configs the comment names in place of the hub's) prints
    the plan the comment gives, and the operator's plan entire."""
    from specdeploy.cli import main

    files = config_sources(path)
    argv = ["plan", "-f", str(path), "--json"]
    for role, file in files.items():
        argv += [f"--{role}-config", str(file)]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    commented = commented_plan(path)
    assert {key: plan_value(printed, key) for key in commented} == commented
    assert printed == operator_plan(path)


def test_examples_cover_the_promised_cases():
    plans = {p.name: (load_sdd(p)["spec"], operator_plan(p)) for p in example_files()}
    algorithms = {spec["speculative"]["algorithm"] for spec, _ in plans.values()}
    assert {"EAGLE3", "MTP"} <= algorithms
    assert any(plan["tensor_parallel_size"] > 1 for _, plan in plans.values()), "no tensor-parallel example"
    assert any(plan["spec_hidden_size"] > plan["target"]["hidden_size"] for _, plan in plans.values()), (
        "no hc_mult > 1 example"
    )
    assert any(plan["tensor_parallel_size"] == 1 for _, plan in plans.values())


def test_tensor_parallel_example_needs_more_than_two_gpus():
    """The 70B example's comment: two H200s hold the weights but not the KV tokens it asks for."""
    from specdeploy.operator.desired.planning import PlanningError, plan_engine

    path = EXAMPLES / "llama-3.3-70b-eagle3-tp.yaml"
    target, draft = model_configs(path)
    spec = load_sdd(path)["spec"]
    spec["gpu"]["perNode"] = 2
    with pytest.raises(PlanningError) as refused:
        plan_engine(spec, target, draft)
    assert refused.value.reason == "InsufficientGPUMemory"
    assert operator_plan(path)["tensor_parallel_size"] == 4


def test_multi_node_example_needs_its_second_node():
    """The 405B example: one node of 8 H100 is refused, two are a LeaderWorkerSet group of 2."""
    from specdeploy.operator.desired.planning import PlanningError, plan_engine

    path = EXAMPLES / "llama-3.1-405b-eagle3-2-nodes.yaml"
    target, draft = model_configs(path)
    spec = load_sdd(path)["spec"]
    planned = plan_engine(spec, target, draft)
    assert (planned.nodes, planned.tensor_parallel_size) == (2, 16)
    spec["gpu"]["maxNodes"] = 1
    with pytest.raises(PlanningError) as refused:
        plan_engine(spec, target, draft)
    assert refused.value.reason == "InsufficientGPUMemory"
    assert "does not fit on 8 x h100" in refused.value.message


def test_demo_example_serves_the_pair_the_engine_image_bakes():
    """tiny-cpu-demo.yaml: its inline configs are what the demo recipe writes, at the paths
    Dockerfile.engine trains the pair into."""
    from specdeploy.engine.demo import train
    from specdeploy.engine.demo.cli import Recipe

    spec = load_sdd(EXAMPLES / "tiny-cpu-demo.yaml")["spec"]
    recipe = Recipe()
    # The demo's tokenizer puts its special tokens first: <|bos|> is 0, <|end|> is 1.
    target = train.llama_config(
        recipe.vocab_size, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=recipe.context_length,
        bos_token_id=train.SPECIAL_TOKENS.index(train.BOS_TOKEN),
        eos_token_id=train.SPECIAL_TOKENS.index(train.EOS_TOKEN),
    )
    assert spec["target"]["config"] == target
    assert spec["draft"]["config"] == train.eagle_config(target)
    assert spec["speculative"]["algorithm"] == "EAGLE"
    assert spec["engine"]["contextLength"] == recipe.context_length

    demo_dir = "/opt/specdeploy/demo"
    assert spec["target"]["model"] == f"{demo_dir}/target" and spec["draft"]["model"] == f"{demo_dir}/draft"
    assert f"ensure_models(Path('{demo_dir}'), Recipe())" in (ROOT / "Dockerfile.engine").read_text()
    # CPU mode: the engine runs on the pod's CPUs, and the pod asks for no GPU.
    assert "gpu" not in spec and spec["cpu"]["memoryGiB"] >= 1
    assert operator_plan(EXAMPLES / "tiny-cpu-demo.yaml")["gpu"] == "cpu"


def update() -> None:
    for path in example_files():
        plan = operator_plan(path)
        text = path.read_text()

        def replace(match: re.Match[str]) -> str:
            key, gap, _ = match.groups()
            if key not in PLAN_KEYS | OPTIONAL_PLAN_KEYS:
                return match.group(0)
            return f"#   {key}:{gap}{plan_value(plan, key)}"

        new = re.sub(r"^#\s+([a-z_]+(?:\.[a-z_]+)*):(\s+)(-?\d+)\s*$", replace, text, flags=re.MULTILINE)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {sys.argv[0]} --update")
    update()
