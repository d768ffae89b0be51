"""Rendering the engine's children from a SpecDecodeDeployment and its plan (pure, no cluster)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdeploy.operator.desired import render
from specdeploy.operator.desired.planning import PlanningError, plan_engine, plan_summary

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULTS = render.EngineDefaults(image="registry.local/specdeploy-engine:test", hub_endpoint="https://hub.local")


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def make_sdd(**spec_overrides) -> dict:
    spec = {
        "target": {"model": "meta-llama/Llama-3.3-70B-Instruct", "revision": "main"},
        "draft": {"model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "revision": "main"},
        "speculative": {"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "engine": {"maxRunningRequests": 32, "contextLength": 8192},
        "gpu": {"product": "h200", "perNode": 8},
        "replicas": 2,
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "specdeploy.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "llama70b", "namespace": "serving", "uid": "0000-uid", "generation": 1},
        "spec": spec,
    }


def planned_for(sdd: dict, target="llama-3.3-70b-instruct", draft="eagle3-llama3.3-instruct-70b"):
    return plan_engine(sdd["spec"], config(target), config(draft) if draft else None)


@pytest.fixture
def sdd():
    return make_sdd()


@pytest.fixture
def children(sdd):
    return render.render_children(sdd, planned_for(sdd), DEFAULTS)


def engine_container(children):
    return children.deployment["spec"]["template"]["spec"]["containers"][0]


def test_gpu_request_equals_tensor_parallel_size(sdd, children):
    planned = planned_for(sdd)
    assert planned.tensor_parallel_size == 2  # 70B bf16 + EAGLE-3 head does not fit one H200
    resources = engine_container(children)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 2
    assert resources["limits"]["nvidia.com/gpu"] == 2


def test_user_cannot_override_gpu_count_but_keeps_cpu_and_memory():
    sdd = make_sdd(engine={"resources": {"requests": {"cpu": "8", "nvidia.com/gpu": 1}, "limits": {"memory": "200Gi"}}})
    container = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))
    assert container["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": 2},
        "limits": {"memory": "200Gi", "nvidia.com/gpu": 2},
    }


def test_engine_command_line(children):
    container = engine_container(children)
    assert container["command"] == ["specdeploy", "engine", "serve"]
    assert container["args"] == [
        "--target", "meta-llama/Llama-3.3-70B-Instruct",
        "--draft", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
        "--algorithm", "EAGLE3",
        "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4",
        "--plan", "/etc/specdeploy/plan.json", "--dtype", "bfloat16",
        "--max-running-requests", "32",
        "--context-length", "8192",
        "--host", "0.0.0.0", "--port", "8000",
        "--drain-timeout-s", "110",
    ]
    assert container["image"] == DEFAULTS.image


def test_the_engine_drains_within_the_pods_grace_period():
    """SIGTERM comes after the preStop sleep; the drain ends a margin before the kubelet's SIGKILL."""
    from specdeploy.cli import build_parser

    sdd = make_sdd(engine={"terminationGracePeriodSeconds": 300})
    children = render.render_children(sdd, planned_for(sdd), DEFAULTS)
    pod = children.deployment["spec"]["template"]["spec"]
    args = engine_container(children)["args"]
    drain = float(args[args.index("--drain-timeout-s") + 1])
    assert drain + render.PRE_STOP_SLEEP_S < pod["terminationGracePeriodSeconds"] == 300
    assert drain == 290
    assert build_parser().parse_args(["engine", "serve", *args]).drain_timeout_s == drain


def test_prefix_cache_is_on_unless_the_spec_turns_it_off(children):
    assert "--no-prefix-cache" not in engine_container(children)["args"]
    sdd = make_sdd(engine={"prefixCache": False})
    args = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["args"]
    assert args[-1] == "--no-prefix-cache"
    # The engine's parser takes what the operator renders.
    from specdeploy.cli import build_parser
    parsed = build_parser().parse_args(["engine", "serve", *args])
    assert parsed.prefix_cache is False


def test_extend_graphs_are_on_unless_the_spec_turns_them_off(children):
    from specdeploy.cli import build_parser
    args = engine_container(children)["args"]
    assert "--no-extend-graphs" not in args
    assert build_parser().parse_args(["engine", "serve", *args]).extend_graphs is True
    sdd = make_sdd(engine={"extendGraphs": False})
    args = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["args"]
    assert args[-1] == "--no-extend-graphs"
    assert build_parser().parse_args(["engine", "serve", *args]).extend_graphs is False


def test_draft_quantization_reaches_the_plan_and_the_engine_and_none_changes_nothing(children):
    sdd = make_sdd(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "draftQuantization": "fp8"})
    planned = planned_for(sdd)
    assert planned.plan["draft"]["quantized_at_load"] == "fp8"
    args = engine_container(render.render_children(sdd, planned, DEFAULTS))["args"]
    assert args[args.index("--draft-quantization") + 1] == "fp8"
    from specdeploy.cli import build_parser
    assert build_parser().parse_args(["engine", "serve", *args]).draft_quantization == "fp8"
    none = make_sdd(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "draftQuantization": "none"})
    rendered = render.render_children(none, planned_for(none), DEFAULTS)
    # The settings (and so the pods' config hash) of a resource without it are as before.
    assert "draft_quantization" not in render.engine_settings(none["spec"])
    assert engine_container(rendered)["args"] == engine_container(children)["args"]


def test_adaptive_speculation_reaches_the_engine_and_off_changes_nothing(children):
    sdd = make_sdd(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "adaptive": True})
    args = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["args"]
    assert args[args.index("--num-draft-tokens") + 2] == "--adaptive-speculation"
    off = make_sdd(speculative={"algorithm": "EAGLE3", "numSteps": 3, "topk": 1, "adaptive": False})
    rendered = render.render_children(off, planned_for(off), DEFAULTS)
    assert "--adaptive-speculation" not in engine_container(rendered)["args"]
    # The settings (and so the pods' config hash) of a resource without adaptive are as before.
    assert "adaptive" not in render.engine_settings(off["spec"])
    assert engine_container(rendered)["args"] == engine_container(children)["args"]
    from specdeploy.cli import build_parser
    assert build_parser().parse_args(["engine", "serve", *args]).adaptive_speculation is True


def test_none_algorithm_has_no_draft_arguments():
    sdd = make_sdd(speculative={"algorithm": "NONE"}, engine={"dtype": "bfloat16"})
    del sdd["spec"]["draft"]
    args = engine_container(render.render_children(sdd, planned_for(sdd, draft=None), DEFAULTS))["args"]
    assert "--draft" not in args and "--num-steps" not in args
    assert args[args.index("--algorithm") + 1] == "NONE"
    assert args[args.index("--dtype") + 1] == "bfloat16"


def test_pinned_revisions_reach_the_engine():
    sdd = make_sdd(
        target={"model": "meta-llama/Llama-3.3-70B-Instruct", "revision": "6f6073b423013f6a7d4d9f39144961bfbfbc386b"},
        draft={"model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "revision": "v1.1"},
    )
    args = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["args"]
    assert args[args.index("--target-revision") + 1] == "6f6073b423013f6a7d4d9f39144961bfbfbc386b"
    assert args[args.index("--draft-revision") + 1] == "v1.1"
    assert args.index("--target") < args.index("--target-revision") < args.index("--draft")


def test_engine_runs_the_dtype_the_plan_sized():
    # No spec.engine.dtype: the target's torch_dtype (float16 here), not the engine's auto (bf16 on GPU).
    sdd = make_sdd()
    fp16 = {**config("llama-3.3-70b-instruct"), "torch_dtype": "float16"}
    planned = plan_engine(sdd["spec"], fp16, config("eagle3-llama3.3-instruct-70b"))
    args = engine_container(render.render_children(sdd, planned, DEFAULTS))["args"]
    assert planned.plan["target"]["dtype"] == "float16"
    assert args[args.index("--dtype") + 1] == "float16"
    # spec.engine.dtype overrides the config's, in the plan and on the command line alike.
    sdd = make_sdd(engine={"dtype": "float32"})
    planned = plan_engine(sdd["spec"], fp16, config("eagle3-llama3.3-instruct-70b"))
    args = engine_container(render.render_children(sdd, planned, DEFAULTS))["args"]
    assert planned.plan["target"]["dtype"] == "float32" and args[args.index("--dtype") + 1] == "float32"


def test_a_dtype_the_engine_cannot_compute_in_is_refused():
    sdd = make_sdd(gpu={"product": "h200", "perNode": 8})
    fp8 = {**config("llama-3.3-70b-instruct"), "torch_dtype": "float8_e4m3fn"}
    with pytest.raises(PlanningError) as err:
        plan_engine(sdd["spec"], fp8, config("eagle3-llama3.3-instruct-70b"))
    assert err.value.reason == "ConfigInvalid" and "spec.engine.dtype" in err.value.message
    sdd = make_sdd(engine={"dtype": "bfloat16"})
    assert plan_engine(sdd["spec"], fp8, config("eagle3-llama3.3-instruct-70b")).plan["target"]["dtype"] == "bfloat16"


def test_unexpected_planner_errors_are_config_invalid(monkeypatch):
    from specdeploy.operator.desired import planning

    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(planning.planner, "plan", broken)
    with pytest.raises(PlanningError) as err:
        planned_for(make_sdd())
    assert err.value.reason == "ConfigInvalid"
    assert "ZeroDivisionError" in err.value.message


def test_probes_and_port(children):
    container = engine_container(children)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    # Model load + CUDA-graph capture: at least 20 minutes before liveness may kill the pod.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    service_port = children.service["spec"]["ports"][0]
    assert (service_port["name"], service_port["port"], service_port["targetPort"]) == ("http", 8000, "http")


def test_scheduling_on_the_planned_gpu_product(children):
    pod = children.deployment["spec"]["template"]["spec"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
    ]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["terminationGracePeriodSeconds"] == 120


def test_config_map_holds_plan_and_engine_settings_and_is_mounted(sdd, children):
    data = children.config_map["data"]
    assert json.loads(data["plan.json"]) == planned_for(sdd).plan
    engine = json.loads(data["engine.json"])
    assert engine["tensor_parallel_size"] == 2 and engine["target_revision"] == "main"
    pod = children.deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["engine-config"]["configMap"]["name"] == children.config_map["metadata"]["name"] == "llama70b-engine"
    # Memory-backed and sized for NCCL: 1 GiB per tensor-parallel rank (the 70B plan is TP 2).
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    # The engine is its own launcher: the plan's tensor_parallel_size starts the ranks.
    assert pod["containers"][0]["command"] == ["specdeploy", "engine", "serve"]
    assert "--plan" in pod["containers"][0]["args"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["engine-config"] == "/etc/specdeploy" and mounts["dshm"] == "/dev/shm"


def test_owner_references_labels_and_namespace(children):
    for child in children.all():
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == "0000-uid" and owner["kind"] == "SpecDecodeDeployment"
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama70b"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "specdeploy-operator"
    selector = children.deployment["spec"]["selector"]["matchLabels"]
    template_labels = children.deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert children.service["spec"]["selector"] == selector
    assert children.deployment["spec"]["replicas"] == 2


def test_owner_labels_do_not_override_ours():
    sdd = make_sdd()
    sdd["metadata"]["labels"] = {"app.kubernetes.io/name": "mine", "team": "a"}
    children = render.render_children(sdd, planned_for(sdd), DEFAULTS)
    labels = children.deployment["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "specdeploy-engine" and labels["team"] == "a"


def test_hash_annotation_changes_with_the_spec_and_only_then(sdd, children):
    template_hash = children.deployment["spec"]["template"]["metadata"]["annotations"]["specdeploy.dev/config-hash"]
    assert template_hash == children.config_hash
    again = render.render_children(copy.deepcopy(sdd), planned_for(sdd), DEFAULTS)
    assert again.config_hash == children.config_hash

    more_requests = make_sdd(engine={"maxRunningRequests": 64, "contextLength": 8192})
    assert render.render_children(more_requests, planned_for(more_requests), DEFAULTS).config_hash != children.config_hash
    new_image = make_sdd(engine={"maxRunningRequests": 32, "contextLength": 8192, "image": "other:1"})
    assert render.render_children(new_image, planned_for(new_image), DEFAULTS).config_hash != children.config_hash
    # Replicas scale the same pods; they must not roll them.
    scaled = make_sdd(replicas=5)
    assert render.render_children(scaled, planned_for(scaled), DEFAULTS).config_hash == children.config_hash


def test_hub_token_and_user_env():
    sdd = make_sdd(
        hub={"endpoint": "https://mirror.local", "tokenSecretRef": {"name": "hf", "key": "t"}},
        engine={"env": [{"name": "HF_HOME", "value": "/models"}, {"name": "LOG_LEVEL", "value": "debug"}]},
    )
    env = {e["name"]: e for e in engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["env"]}
    assert env["HF_ENDPOINT"]["value"] == "https://mirror.local"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t"}
    assert env["HF_HOME"]["value"] == "/models"  # the user's value wins, once
    assert env["LOG_LEVEL"]["value"] == "debug"


def test_paused_annotation():
    assert render.is_paused({"annotations": {"specdeploy.dev/paused": "true"}})
    assert render.is_paused({"annotations": {"specdeploy.dev/paused": "True"}})
    assert not render.is_paused({"annotations": {"specdeploy.dev/paused": "false"}})
    assert not render.is_paused({})


def test_unfittable_plan_is_refused_with_the_numbers():
    sdd = make_sdd(gpu={"product": "h100", "perNode": 1})
    with pytest.raises(PlanningError) as err:
        planned_for(sdd)
    assert err.value.reason == "InsufficientGPUMemory"
    assert "GiB" in err.value.message and "h100" in err.value.message


def test_invalid_config_names_the_model_and_field():
    sdd = make_sdd()
    broken = config("eagle3-llama3.3-instruct-70b")
    del broken["hidden_size"]
    with pytest.raises(PlanningError) as err:
        plan_engine(sdd["spec"], config("llama-3.3-70b-instruct"), broken)
    assert err.value.reason == "ConfigInvalid"
    assert err.value.message.startswith("spec.draft config.json:")
    assert "hidden_size" in err.value.message


def test_memory_override_keeps_the_product_label():
    sdd = make_sdd(gpu={"product": "h200", "memoryGiB": 40, "perNode": 8})
    planned = planned_for(sdd)
    assert planned.gpu_product_label == "NVIDIA-H200"
    assert planned.tensor_parallel_size == 8  # 40 GiB each: 70B bf16 needs eight of them
    assert "TP 8" in plan_summary(planned)


def make_cpu_sdd(**spec_overrides) -> dict:
    """The demo-sized pair in CPU mode (spec.cpu, no spec.gpu)."""
    spec = {
        "target": {"model": "/opt/specdeploy/demo/target", "config": TINY_TARGET},
        "draft": {"model": "/opt/specdeploy/demo/draft", "config": TINY_DRAFT},
        "speculative": {"algorithm": "EAGLE", "numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "engine": {"maxRunningRequests": 4, "contextLength": 1024,
                   "resources": {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}},
        "cpu": {"memoryGiB": 3},
        "replicas": 1,
    }
    spec.update(spec_overrides)
    sdd = make_sdd(**spec)
    del sdd["spec"]["gpu"]
    return sdd


TINY_TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32", "vocab_size": 1024,
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
}
TINY_DRAFT = {**TINY_TARGET, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1}


def plan_cpu(sdd: dict):
    return plan_engine(sdd["spec"], sdd["spec"]["target"]["config"], sdd["spec"]["draft"]["config"])


def test_cpu_mode_requests_no_gpu_and_pins_no_gpu_node():
    sdd = make_cpu_sdd()
    planned = plan_cpu(sdd)
    assert planned.cpu and planned.tensor_parallel_size == 1
    assert planned.plan["gpu"] == "cpu" and planned.plan["gpus_per_node"] == 1
    assert planned.plan["memory_per_gpu"]["gpu_memory_bytes"] == 3 * 1024**3
    children = render.render_children(sdd, planned, DEFAULTS)
    pod = children.deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The user's CPU and memory, and no nvidia.com/gpu at all.
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    assert "affinity" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in json.dumps(children.deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    # The engine gets its arguments as usual, with the planned dtype.
    args = container["args"]
    assert args[args.index("--target") + 1] == "/opt/specdeploy/demo/target"
    assert args[args.index("--algorithm") + 1] == "EAGLE"
    assert args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--plan") + 1] == "/etc/specdeploy/plan.json"
    assert json.loads(children.config_map["data"]["plan.json"])["tensor_parallel_size"] == 1
    assert "TP 1 x cpu" in plan_summary(planned)
    assert f"max_total_tokens {planned.plan['max_total_tokens']} (needs" in plan_summary(planned)


def test_cpu_mode_drops_a_user_gpu_request_and_lets_user_env_win():
    sdd = make_cpu_sdd(engine={"maxRunningRequests": 4, "contextLength": 1024,
                               "resources": {"requests": {"nvidia.com/gpu": 1}},
                               "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]})
    container = engine_container(render.render_children(sdd, plan_cpu(sdd), DEFAULTS))
    assert container["resources"] == {"requests": {}, "limits": {}}
    assert [e for e in container["env"] if e["name"] == "CUDA_VISIBLE_DEVICES"] == [
        {"name": "CUDA_VISIBLE_DEVICES", "value": "0"}
    ]


def test_cpu_mode_is_tensor_parallel_one_even_when_that_does_not_fit():
    sdd = make_sdd(cpu={"memoryGiB": 64})
    del sdd["spec"]["gpu"]
    with pytest.raises(PlanningError) as err:
        planned_for(sdd)  # 70B bf16 needs 131 GiB of weights; no tensor parallelism on CPU
    assert err.value.reason == "InsufficientGPUMemory" and "1 x cpu" in err.value.message


def test_gpu_mode_is_unchanged_by_cpu_mode(sdd, children):
    planned = planned_for(sdd)
    assert not planned.cpu
    pod = children.deployment["spec"]["template"]["spec"]
    assert set(pod) >= {"affinity", "tolerations"}
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert not env & {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}


def test_operator_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import specdeploy.operator.desired.render, specdeploy.operator.desired.status, specdeploy.operator.desired.planning\n"
        "import specdeploy.operator.cluster.config_source, specdeploy.operator.cluster.kube, specdeploy.operator.cluster.serving_metrics\n"
        "import specdeploy.operator.handlers, specdeploy.operator.cli, specdeploy.cli\n"
        "specdeploy.operator.handlers.build_registry(specdeploy.operator.handlers.OperatorOptions())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_served_model_name_reaches_the_engine_and_only_when_set():
    sdd = make_sdd(servedModelName="llama-70b")
    args = engine_container(render.render_children(sdd, planned_for(sdd), DEFAULTS))["args"]
    assert args[args.index("--served-model-name") + 1] == "llama-70b"
    plain = make_sdd()
    assert "--served-model-name" not in engine_container(render.render_children(plain, planned_for(plain), DEFAULTS))["args"]
