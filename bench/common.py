"""Shared helpers for the benchmark suite: the checkout bootstrap, timing, ceilings, memory
readings, the Llama-3.1-8B shape, result records.

Benchmarks are not tests: they run on the device, take medians of many timed repetitions with
CUDA events (perf_counter on CPU, where only --smoke runs), and write JSON that bench/report.py
turns into docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def bootstrap_specdeploy(root: Path = REPO_ROOT) -> None:
    """Make `specdeploy` and `specdeploy.engine` importable from this checkout without installing
    it (a GPU machine may have the sources but not the installed package): register both packages from their
    folders so that `import specdeploy.engine.models.llama` resolves to engine/models/llama.py next to us."""
    if "specdeploy.engine" in sys.modules:
        return
    top = root / "specdeploy"
    init = top / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location("specdeploy", init,
                                                      submodule_search_locations=[str(top)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["specdeploy"] = pkg
        spec.loader.exec_module(pkg)
    else:
        pkg = types.ModuleType("specdeploy")
        pkg.__path__ = [str(top)]
        sys.modules["specdeploy"] = pkg
    engine_dir = root / "engine"
    spec = importlib.util.spec_from_file_location("specdeploy.engine", engine_dir / "__init__.py",
                                                  submodule_search_locations=[str(engine_dir)])
    engine = importlib.util.module_from_spec(spec)
    sys.modules["specdeploy.engine"] = engine
    spec.loader.exec_module(engine)
    pkg.engine = engine


import torch  # noqa: E402  (after the bootstrap's definition; torch itself needs no bootstrap)

# Llama-3.1-8B's published shape (config.json of meta-llama/Llama-3.1-8B-Instruct).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}

# A tiny model of the same family for --smoke (5 layers: EAGLE-3's default aux layers need 5).
TINY_LLAMA = {
    **LLAMA_31_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


class Mark:
    """A point on the device timeline: a recorded CUDA event, or a host clock reading on CPU
    (where every op is synchronous, so the host clock is the device clock)."""

    def __init__(self, device):
        if is_cuda(device):
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.t = None
        else:
            self.event = None
            self.t = time.perf_counter()

    def ms_until(self, later: "Mark") -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event)
        return (later.t - self.t) * 1e3


def time_ms(fn, device, *, warmup: int = 3, reps: int = 20) -> dict:
    """Time `fn()` on the current stream: median, min and max over `reps` runs after `warmup`
    runs, in milliseconds (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = Mark(device)
        fn()
        end = Mark(device)
        sync(device)
        times.append(start.ms_until(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "reps": reps}


def graph_replay_ms(calls, device, *, warmup: int = 3, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph holding `calls` (in order). They run once eagerly
    first: compiles, probes and workspaces happen outside the capture."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = time_ms(graph.replay, device, warmup=warmup, reps=reps)["median_ms"]
    del graph
    return ms


def calls_ms(calls, device, *, warmup: int, reps: int, cpu_reps: int = 2) -> float:
    """Median ms of one replay of a CUDA graph holding `calls` (graph_replay_ms); on CPU the
    calls timed directly, `cpu_reps` times after one warm-up (smoke runs under the interpreter)."""
    if torch.device(device).type != "cuda":
        return time_ms(lambda: [c() for c in calls], device, warmup=1, reps=cpu_reps)["median_ms"]
    return graph_replay_ms(calls, device, warmup=warmup, reps=reps)


def cuda_time_ms(fn, *, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of `fn()` on the current stream in milliseconds, timed with CUDA events."""
    return time_ms(fn, "cuda", warmup=warmup, reps=reps)["median_ms"]


def copy_bandwidth_bytes_per_s(size_bytes: int = 4 << 30, device="cuda") -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (the HBM ceiling).
    Random data, a buffer many times the L2."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, reps=20)["median_ms"]
    return 2 * size_bytes / (ms / 1e3)


def matmul_flops_per_s(n: int = 8192, device="cuda", dtype=torch.bfloat16) -> float:
    """Dense [n, n] x [n, n] matrix product rate on random data (the arithmetic ceiling)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, reps=10)["median_ms"]
    return 2 * n ** 3 / (ms / 1e3)


def nvidia_smi_used_bytes() -> int | None:
    """GPU 0's used memory as nvidia-smi reports it (all processes), or None without the tool."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=20)
        return int(out.stdout.strip().splitlines()[0]) * 1024 ** 2 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def device_memory(device) -> dict:
    """What the process holds now: torch allocator counters and the driver's view."""
    if not is_cuda(device):
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "driver_used": total - free,
        "driver_total": total,
        "nvidia_smi_used": nvidia_smi_used_bytes(),
    }


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # a missing optional package is recorded, not fatal
        return None


def source_commit() -> str | None:
    """The commit the measured code is: $SPECDEPLOY_BENCH_COMMIT (a copy of the checkout without its
    .git, as the GPU machine gets, says it there), else `git rev-parse` of this checkout."""
    if os.environ.get("SPECDEPLOY_BENCH_COMMIT"):
        return os.environ["SPECDEPLOY_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# The planner's GPU catalog entry for a device name (engine/planner/plan.py GPUS): a plan made for
# another card's memory sizes the KV pools wrong and its planner-truth rows mean nothing.
CATALOG_BY_NAME = (("H100", "h100"), ("H200", "h200"), ("A100", "a100-80g"), ("L40S", "l40s"))


def catalog_gpu(device, default: str = "h200") -> str:
    """The catalog name of the GPU `device` is (the first CATALOG_BY_NAME substring of its name),
    `default` where none matches."""
    name = torch.cuda.get_device_name(device)
    return next((entry for part, entry in CATALOG_BY_NAME if part in name), default)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": props.name if props else "cpu",
        "device_memory_bytes": props.total_memory if props else 0,
        "sm_count": props.multi_processor_count if props else 0,
        "cpu_count": os.cpu_count(),
    }
    for mod in ("transformers", "triton", "tokenizers", "safetensors", "matplotlib"):
        env[mod] = _version(mod)
    env["commit"] = source_commit()
    if props:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                  "--format=csv,noheader", "-i", "0"],
                                 capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["nvidia_smi"] = None
    return env


def out_dir() -> Path:
    return Path(os.environ.get("SPECDEPLOY_BENCH_OUT") or ".bench")


def write_json(name: str, data, directory: Path | None = None) -> Path:
    out = directory or out_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=2, default=str))
    log(f"wrote {path}")
    return path


def cuda_probe_args(description: str | None = None):
    """The command line of a CUDA-only diagnostic (bench/*_probe.py): --out DIR for its JSON;
    exits with a message on a machine without CUDA."""
    import argparse
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON (none: log only)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("CUDA only")
    return args


def argv_command() -> str:
    return " ".join(["python3", *sys.argv])


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
