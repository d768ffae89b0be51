"""`specdeploy engine serve --plan`: the operator's plan is what the engine allocates."""

from __future__ import annotations

import json
import logging
import re

import openai

from specdeploy.engine.planner.plan import Limits, SpecSettings, custom_gpu, plan_from_configs
from specdeploy.engine.serving.cli import ServerThread, free_port
from specdeploy.engine.planner.weights import load_model_path


def test_serve_allocates_the_given_plan_and_reports_differences(model_dirs, tmp_path, caplog):
    target_dir, draft_dir = model_dirs
    target_config, target_bytes = load_model_path(target_dir)
    draft_config, draft_bytes = load_model_path(draft_dir)
    plan = plan_from_configs(target_config, draft_config, SpecSettings("EAGLE", 3, 1, 4), custom_gpu(4.0),
                             Limits(max_running_requests=2, context_length=128, cuda_graph_max_bs=2),
                             target_weight_bytes=target_bytes, draft_weight_bytes=draft_bytes, gpus_per_node=1)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan.to_dict()))

    caplog.set_level(logging.INFO, logger="specdeploy")
    running = ServerThread([
        "engine", "serve", "--target", str(target_dir), "--draft", str(draft_dir),  # the plan says EAGLE
        "--plan", str(plan_path), "--dtype", "float32", "--max-running-requests", "8", "--max-total-tokens", "1024",
        "--served-model-name", "planned", "--host", "127.0.0.1", "--port", str(free_port())]).start(timeout_s=120)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        # The plan's context (128) wins over the model's 256; a draft tree's lookahead is kept back.
        card = client.models.retrieve("planned")
        assert card.model_extra["max_model_len"] == 128 - 3 - 1
        out = client.completions.create(model="planned", prompt="x", max_tokens=8, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        runner = running.state.scheduler.runner
        assert runner.max_running_requests == 2 and runner.table.capacity == 1024
    finally:
        running.stop()
    logs = caplog.text
    assert f"plan: read from {plan_path}" in logs
    assert "max_running_requests is 2 in the plan and 8 on the command line; using the plan's" in logs
    assert "algorithm is" not in logs and "num_steps is" not in logs  # not given, so nothing to compare
    assert "plan check: weights" in logs and "plan check: KV cache" in logs
    assert "max_total_tokens" in logs  # the plan's table


def test_serve_an_fp8_checkpoint_with_an_fp8_kv_cache(model_dirs, tmp_path, caplog):
    """The tiny target quantized to an FP8 block checkpoint (e4m3 + weight_scale_inv, as DeepSeek
    and Qwen publish them) and served with --kv-cache-dtype fp8_e4m3: the plan counts the
    checkpoint's header bytes and one byte per K/V element, the engine holds exactly that, and
    the OpenAI API answers."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from specdeploy.engine.models import fp8

    target_dir, draft_dir = model_dirs
    fp8_dir = tmp_path / "fp8-target"
    shutil.copytree(target_dir, fp8_dir)
    fmt = fp8.FP8Format("block", "weight_scale_inv", (128, 128))
    tensors = fp8.quantize_state_dict(load_file(str(target_dir / "model.safetensors")), fmt)
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": fp8.quantization_config(fmt)}))

    caplog.set_level(logging.INFO, logger="specdeploy")
    running = ServerThread([
        "engine", "serve", "--target", str(fp8_dir), "--draft", str(draft_dir), "--algorithm", "EAGLE",
        "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3", "--max-running-requests", "2",
        "--max-total-tokens", "1024", "--served-model-name", "fp8", "--host", "127.0.0.1",
        "--port", str(free_port())]).start(timeout_s=120)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="fp8", prompt="def ", max_tokens=8, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        runner = running.state.scheduler.runner
        assert runner.target_kv.k.dtype == runner.draft_kv.k.dtype == torch.float8_e4m3fn
        assert runner.target.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    finally:
        running.stop()
    logs = caplog.text
    assert "fp8: 24 linears from block weight_scale_inv checkpoint weights" in logs
    assert "fp8_e4m3" in logs  # the plan's table names the KV dtype
    checks = [line for line in logs.splitlines() if "plan check: weights" in line or "plan check: KV cache" in line]
    assert len(checks) == 2
    # "plan check: weights 184 KiB measured vs 180 KiB planned (+2.4%)": the tiny model's fused
    # parts (32 and 64 rows) cut its 128-row scale blocks, so the engine keeps one scale per row
    # where the checkpoint has one per block; real models' parts fill whole blocks.
    for line in checks:
        assert abs(float(re.search(r"\(([-+][0-9.]+)%\)", line).group(1))) < 5.0, line


def test_serve_a_draft_quantized_at_load(model_dirs, server, caplog):
    """--draft-quantization fp8: the head's linears become e4m3 as they load, the plan counts
    exactly the bytes the engine then holds, and greedy output is the unquantized server's."""
    import torch

    from engine_server import serve_argv

    caplog.set_level(logging.INFO, logger="specdeploy")
    running = ServerThread(serve_argv(*model_dirs, free_port(), "--draft-quantization", "fp8")).start(timeout_s=120)
    prompts = ["def ", "import torch\n", "class Plan"]
    try:
        runner = running.state.scheduler.runner
        assert runner.draft.fc.weight.dtype == torch.float8_e4m3fn
        assert runner.draft.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        assert runner.draft.layers[0].post_attention_layernorm.weight.dtype == torch.float32
        outputs = {}
        for name, url in (("fp8", running.base_url), ("none", server.url)):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            outputs[name] = [client.completions.create(model=server.model, prompt=p, max_tokens=24, temperature=0,
                                                       extra_body={"ignore_eos": True}).choices[0].text
                             for p in prompts]
        assert outputs["fp8"] == outputs["none"]
    finally:
        running.stop()
    logs = caplog.text
    assert "draft: 5 linears quantized to fp8 as planned (e4m3, 128x128 block scales); its other weights stay float32" in logs
    assert "linears quantized to fp8 at load" in logs  # the plan's table
    check = next(line for line in logs.splitlines() if "plan check: weights" in line)
    assert check.endswith("(+0.0%)"), check
