"""`specdeploy plan`: through main() and through the installed console script, good and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from specdeploy.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REPO = Path(__file__).resolve().parents[3]
LLAMA = str(CONFIGS / "llama-3.1-8b-instruct.json")
EAGLE3 = str(CONFIGS / "eagle3-llama3.1-instruct-8b.json")
V4 = str(CONFIGS / "deepseek-v4-flash.json")


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_eagle3_json(capsys):
    d = run_json(capsys, "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3")
    assert d["spec_hidden_size"] == 4096
    assert d["draft_input_hidden_size"] == 12288
    assert d["target"]["kv_cache_bytes_per_token"] == 131072
    assert d["target"]["hidden_size"] == 4096 and d["target"]["hc_mult"] == 1
    assert d["draft"]["num_layers"] == 1
    assert d["tensor_parallel_size"] == 1
    assert d["buffers"]["metadata_hidden_states_bytes_per_request"] == 4096 * 2
    assert d["buffers"]["verify_hidden_states_shape"] == [32 * 4, 12288]



def test_role_plans_a_split_server(capsys):
    both = run_json(capsys, "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3")
    prefill = run_json(capsys, "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3", "--role", "prefill")
    assert both["role"] == "both" and both["buffers"]["transfer_staging_bytes"] == 0
    assert prefill["role"] == "prefill" and prefill["cuda_graph_batch_sizes"] == []
    assert prefill["buffers"]["transfer_staging_bytes"] > 2 * 8192 * (131072 + 4096)
    assert main(["plan", "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3", "--role", "decode"]) == 0
    assert "transfer staging (host)" in capsys.readouterr().out


def test_deepseek_v4_mtp_json(capsys):
    d = run_json(capsys, "--target", V4, "--algorithm", "MTP", "--steps", "1", "--gpu", "h100")
    assert d["spec_hidden_size"] == 16384 and d["draft_input_hidden_size"] == 16384
    assert d["target"]["hc_mult"] == 4 and d["draft"]["hc_mult"] == 4
    assert d["buffers"]["metadata_hidden_states_bytes_per_request"] == 16384 * 2
    assert d["num_draft_tokens"] == 2


def test_deepseek_v4_both_naming_schemes_plan_alike(capsys):
    newer = str(CONFIGS / "deepseek-v4-flash-layer-types.json")
    argv = ("--algorithm", "MTP", "--steps", "2", "--topk", "2", "--draft-tokens", "4", "--context-length", "65536")
    a, b = run_json(capsys, "--target", V4, *argv), run_json(capsys, "--target", newer, *argv)
    assert a == b
    assert a["target"]["kv_cache_bytes_per_request_per_gpu"] > 0 and a["tensor_parallel_size"] == 2  # FP8 + FP4 experts, not bf16


def test_options_reach_the_plan(capsys):
    d = run_json(
        capsys, "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3", "--gpu-memory-gib", "40",
        "--gpus-per-node", "4", "--steps", "2", "--topk", "4", "--draft-tokens", "6",
        "--max-running-requests", "8", "--context-length", "4096",
    )
    assert d["gpu"] == "custom" and d["memory_per_gpu"]["gpu_memory_bytes"] == 40 * 1024**3
    assert (d["num_steps"], d["topk"], d["num_draft_tokens"]) == (2, 4, 6)
    assert d["buffers"]["draft_hidden_states_shape"] == [8 * 4, 4096]
    assert d["required_tokens"] == 8 * 4096
    assert d["cuda_graph_batch_sizes"] == [1, 2, 4, 8]


def test_human_table_lists_every_term(capsys):
    assert main(["plan", "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3"]) == 0
    out = capsys.readouterr().out
    for term in ("spec_hidden_size", "draft_input_hidden_size", "tensor_parallel_size", "max_total_tokens",
                 "weights", "CUDA-graph pool", "activation workspace", "static buffers", "reserve",
                 "KV budget", "KV bytes per token", "verify hidden_states", "[128, 12288]", "cuda_graph_batch_sizes"):
        assert term in out, term


def test_model_directory_weights_from_safetensors(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    shutil.copy(LLAMA, model / "config.json")
    save_file({"w": np.zeros((1024, 1024), dtype=np.float16)}, str(model / "model.safetensors"))
    d = run_json(capsys, "--target", str(model), "--algorithm", "NONE")
    assert d["target"]["weight_source"] == "headers"
    assert d["target"]["weight_bytes"] == 1024 * 1024 * 2
    assert d["draft"] is None


def write(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def llama_without(field: str) -> str:
    config = json.loads(Path(LLAMA).read_text())
    del config[field]
    return json.dumps(config)


def v4_without(key: str) -> str:
    config = json.loads(Path(V4).read_text())
    del config[key]
    return json.dumps(config)


BAD = [
    (lambda t: ["--target", str(t / "missing.json"), "--algorithm", "NONE"], "no such file"),
    (lambda t: ["--target", write(t, "bad.json", "{oops"), "--algorithm", "NONE"], "not valid JSON"),
    (lambda t: ["--target", write(t, "nohidden.json", llama_without("hidden_size")), "--algorithm", "NONE"], "hidden_size"),
    (lambda t: ["--target", write(t, "dtype.json", Path(LLAMA).read_text().replace("bfloat16", "int3")), "--algorithm", "NONE"], "torch_dtype"),
    (lambda t: ["--target", LLAMA, "--algorithm", "EAGLE3"], "--draft"),
    (lambda t: ["--target", LLAMA, "--algorithm", "EAGLE"], "--draft"),
    (lambda t: ["--target", LLAMA, "--algorithm", "MTP"], "num_nextn_predict_layers"),
    (lambda t: ["--target", str(CONFIGS / "deepseek-v3.json"), "--algorithm", "MTP", "--gpu", "h100"], "does not fit"),
    (lambda t: ["--target", LLAMA, "--draft", EAGLE3, "--algorithm", "EAGLE3", "--draft-tokens", "9"], "num_draft_tokens"),
    (lambda t: ["--target", LLAMA, "--algorithm", "NONE", "--gpu-memory-gib", "-1"], "positive"),
    # a DeepSeek-V4 config with no attention schedule once crashed the plan (division by zero)
    (lambda t: ["--target", write(t, "v4.json", v4_without("compress_ratios")), "--algorithm", "MTP"], "compress_ratios"),
    (lambda t: ["--target", write(t, "v4w.json", v4_without("sliding_window")), "--algorithm", "NONE"], "sliding_window"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert main(["plan", *argv(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("specdeploy plan: ")


def console_script() -> str:
    path = shutil.which("specdeploy")
    if path is None:
        pytest.fail("the specdeploy console script is not installed (pip install -e '.[dev]')")
    return path


def test_console_script_prints_the_plan():
    result = subprocess.run(
        [console_script(), "plan", "--target", V4, "--algorithm", "MTP", "--steps", "1", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["spec_hidden_size"] == 16384


def test_console_script_bad_input_has_no_traceback(tmp_path):
    result = subprocess.run(
        [console_script(), "plan", "--target", str(tmp_path / "nope"), "--algorithm", "EAGLE3", "--draft", EAGLE3],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "no such file" in result.stderr


# ---- manners ------------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("specdeploy ")


def test_gpu_and_algorithm_in_any_case(capsys):
    lower = run_json(capsys, "--target", LLAMA, "--draft", EAGLE3, "--algorithm", "eagle3", "--gpu", "H100")
    assert lower["algorithm"] == "EAGLE3" and lower["gpu"] == "h100"


def test_a_gpu_outside_the_catalog_names_the_memory_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--target", LLAMA, "--algorithm", "NONE", "--gpu", "l4"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "'l4' is not in the catalog" in err and "--gpu-memory-gib" in err


def test_a_context_beyond_the_models_positions_is_refused_unless_asked_for(capsys, tmp_path):
    assert main(["plan", "--target", LLAMA, "--algorithm", "NONE", "--context-length", "200000"]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings 131072" in err and "--allow-long-context" in err and err.count("\n") == 1
    d = run_json(capsys, "--target", LLAMA, "--algorithm", "NONE", "--context-length", "200000", "--allow-long-context",
                 "--max-running-requests", "1")
    assert d["context_length"] == 200000
    # The default is the smaller of 8192 and the model's positions (the EAGLE-3 head's 2048 is no target's).
    short = {**json.loads(Path(LLAMA).read_text()), "max_position_embeddings": 4096}
    path = tmp_path / "short.json"
    path.write_text(json.dumps(short))
    assert run_json(capsys, "--target", str(path), "--algorithm", "NONE")["context_length"] == 4096


def test_plan_into_a_closed_pipe_is_quiet():
    """`specdeploy plan ... | head -1`: head exits after one line; no BrokenPipeError, exit 0."""
    result = subprocess.run(f"'{console_script()}' plan --target '{LLAMA}' --algorithm NONE --json | head -c 1; "
                            "echo \" rc=${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout == "{ rc=0\n" and result.stderr == "", result.stderr
