"""`specdeploy engine serve` once its flags are parsed: `boot` builds the server that
cli.run (what the operator's Deployment runs) and cli.ServerThread start.

Start-up, as `kubectl logs` shows it: the plan (read from --plan, i.e. the operator's ConfigMap,
or computed here from the same function), weight loading with timings, KV-pool allocation checked
against the plan, a warm-up step, then ready. Loading happens after the HTTP server is up, so
/health answers at once and /ready turns 200 only when the engine can serve.

Tensor parallelism (the plan's tensor_parallel_size N > 1, or --tensor-parallel-size): this
process is rank 0 (HTTP, scheduler, GPU 0) and starts ranks 1..N-1 itself, one process per GPU
(`tp_worker`, spawned; no launcher tool needed). Every rank loads only its own shards and builds
the same Runner (`build_runner`); rank 0 drives them in lockstep (engine/runtime/distributed.py).
A rank that dies ends the server with exit code 1 and a log line naming it.

Across pods (a plan of more than one node, run as a LeaderWorkerSet group; the LWS_* variables
set): every pod runs this same command. The leader pod (LWS_WORKER_INDEX 0) is rank 0 as above
and starts its other local ranks; each worker pod starts its own ranks (`serve_worker_pod`: no
HTTP) and they all meet through engine/runtime/group.py before joining one torch group. The
leader is ready only when every rank of every pod has loaded its shards; a lost pod stops the
leader with exit code 1 (and a worker pod whose leader is gone), so LWS recreates the group.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from typing import Any, NoReturn

from specdeploy.engine.planner.options import DEFAULTS, default_context_length, options_from_args
from specdeploy.engine.runtime.group import GroupError, PodGroup, pod_group

log = logging.getLogger("specdeploy.engine")

# Requests waiting for admission, per running-request slot, before new ones get 429.
QUEUE_PER_RUNNING_REQUEST = 4
# How long an idle kept-alive connection stays open.
KEEP_ALIVE_TIMEOUT_S = 30
# After a finished drain: how long the last responses may take to go out before they are cut.
SHUTDOWN_TIMEOUT_S = 5


def configure_logging(rank: int | None = None, node: str = "", level: str = "info") -> None:
    # Every rank logs to the same stream (kubectl logs); ranks other than 0 say which they are,
    # and across pods every rank says its node too.
    if node:  # a worker pod knows its ranks only once it has the plan
        where = f"[tp{rank} {node}] " if rank is not None else f"[{node}] "
    else:
        where = "" if not rank else f"[tp{rank}] "
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")


def server_config(args: argparse.Namespace):
    """-> (uvicorn's Config without its app, the ConnectionLimits for create_app)."""
    import uvicorn

    from specdeploy.engine.serving.limits import ConnectionLimits, bounded_h11_protocol

    limits = ConnectionLimits(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout_s,
                              body_timeout_s=args.body_timeout_s, max_concurrent_requests=args.max_concurrent_requests)
    config = uvicorn.Config(None, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
                            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
                            http=bounded_h11_protocol(args.header_timeout_s))
    return config, limits


def load_failed(server, error: BaseException) -> None:
    """Loading failed after the server started: one line, and exit 2 (the user's to fix) or 1."""
    from specdeploy.engine.serving import startup

    server.fail(error)
    server.exit_code = startup.report(error)


@dataclasses.dataclass
class Booted:
    """One `engine serve` server, built and not yet running: uvicorn's server with the app, its
    state (what /ready reports; the scheduler once loaded) and the handle on the other ranks."""

    state: Any
    server: Any  # server.DrainingServer
    ranks: TensorParallelRanks


def boot(args: argparse.Namespace, guard=None) -> Booted:
    """Build the server of checked `args` (cli.check_args) and auth `guard`: the app answers
    /health at once and loads the engine (load_engine) in a worker thread once it runs."""
    from specdeploy.engine.serving.metrics import EngineMetrics
    from specdeploy.engine.serving.server import DrainingServer, EngineState, create_app

    model_name = args.served_model_name or args.target
    state = EngineState(model_name=model_name, metrics=EngineMetrics(model_name), role=args.role)
    config, limits = server_config(args)
    server = DrainingServer(config, state, drain_timeout_s=args.drain_timeout_s)
    ranks = TensorParallelRanks()
    config.app = create_app(state, loader=lambda metrics: load_engine(args, metrics, ranks, guard, state.load_progress),
                            on_load_failure=lambda e: load_failed(server, e), limits=limits, guard=guard)
    return Booted(state, server, ranks)


def _spec_settings(args: argparse.Namespace):
    """SpecSettings from the command line (no --plan)."""
    from specdeploy.engine.planner.plan import SpecSettings

    algorithm = args.algorithm or "NONE"
    quantization = args.draft_quantization or DEFAULTS.draft_quantization
    if algorithm == "NONE":
        return SpecSettings("NONE", 0, 0, 0, quantization)
    steps = args.num_steps or DEFAULTS.num_steps
    return SpecSettings(algorithm, steps, args.topk or DEFAULTS.topk, args.num_draft_tokens or steps + 1,
                        quantization)


def resolve_model_path(name: str, revision: str = "main") -> Path:
    """A local directory, else an HF id at `revision`: from the local HF cache, else fetched from
    $HF_ENDPOINT into that cache (a volume in the cluster, so a restarted pod does not fetch again)."""
    from specdeploy.engine.serving import hub

    path = Path(name)
    if path.is_dir():
        return path
    if path.is_absolute() or name.startswith("."):
        raise FileNotFoundError(f"{name}: no such directory")
    snapshot = hub.cached_snapshot(name, revision)
    if snapshot is not None:
        log.info("%s@%s: found in the HF cache at %s", name, revision, snapshot)
        return snapshot
    return hub.fetch_model(name, revision)


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def _host_gpu(device: str, fraction: float = 1.0):
    """The device the plan is made for: `fraction` of the GPU as torch sees it; on CPU, of the
    machine's RAM."""
    import torch

    from specdeploy.engine.planner.plan import GIB, custom_gpu

    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return custom_gpu(fraction * total / GIB)


def _check_gpus(tensor_parallel_size: int, device: str) -> None:
    """A plan for N GPUs needs N visible GPUs (CPU ranks share the host)."""
    if device != "cuda":
        return
    import torch

    visible = torch.cuda.device_count()
    if tensor_parallel_size > visible:
        raise ValueError(f"the plan needs tensor_parallel_size {tensor_parallel_size} GPUs; "
                           f"this pod sees {visible}")


def make_plan(args: argparse.Namespace, target_dir: Path, draft_dir: Path | None, device: str, nodes: int = 1):
    """The plan from --plan, else made here for --tensor-parallel-size ranks over `nodes` pods."""
    from specdeploy.engine.planner.plan import Limits, Plan, plan_from_configs
    from specdeploy.engine.planner.cli import format_plan
    from specdeploy.engine.planner.weights import UNUSED_HEAD_TENSORS, load_model_path

    if args.plan:
        plan = Plan.from_dict(json.loads(Path(args.plan).read_text()))
        log.info("plan: read from %s", args.plan)
        asked = {"algorithm": args.algorithm, "num_steps": args.num_steps, "topk": args.topk,
                 "num_draft_tokens": args.num_draft_tokens, "max_running_requests": args.max_running_requests,
                 "context_length": args.context_length}
        if plan.role != args.role:
            raise ValueError(f"the plan is for role {plan.role!r}; this server runs --role {args.role}")
        asked["tensor_parallel_size"] = args.tensor_parallel_size
        for key, value in asked.items():
            if value is not None and getattr(plan, key) != value:
                log.warning("plan: %s is %s in the plan and %s on the command line; using the plan's",
                            key, getattr(plan, key), value)
        if args.kv_cache_dtype is not None and args.kv_cache_dtype != plan.target.kv_cache_dtype:
            log.warning("plan: kv_cache_dtype is %s in the plan and %s on the command line; using the plan's",
                        plan.target.kv_cache_dtype, args.kv_cache_dtype)
        planned = plan.draft.quantized_at_load if plan.draft else "none"
        if args.draft_quantization is not None and args.draft_quantization != planned:
            log.warning("plan: draft_quantization is %s in the plan and %s on the command line; using the plan's",
                        planned, args.draft_quantization)
    else:
        target_config, target_weight_bytes = load_model_path(target_dir)
        draft_config, draft_weight_bytes = (load_model_path(draft_dir, UNUSED_HEAD_TENSORS)
                                            if draft_dir else (None, None))
        spec = _spec_settings(args)
        context_length = args.context_length or default_context_length(target_config)
        running = args.max_running_requests or DEFAULTS.max_running_requests
        limits = Limits(running, context_length, running)
        tp = args.tensor_parallel_size or nodes
        if tp % nodes:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide over the group's {nodes} pods")
        # Planned in the dtype this server computes in (--dtype), not the checkpoint's: the KV
        # bytes per token and the disaggregation metadata row are that dtype's.
        plan = plan_from_configs(target_config, draft_config, spec,
                                 _host_gpu(device, args.gpu_memory_fraction), limits,
                                 target_weight_bytes=target_weight_bytes, draft_weight_bytes=draft_weight_bytes,
                                 gpus_per_node=tp // nodes, tensor_parallel_size=tp, max_nodes=nodes, role=args.role,
                                 kv_cache_dtype=args.kv_cache_dtype or "auto",
                                 dtype=str(_torch_dtype(args.dtype, device)).removeprefix("torch."))
        share = f", {args.gpu_memory_fraction:g} of its memory" if args.gpu_memory_fraction != 1 else ""
        log.info("plan: computed for this %s%s (no --plan given)", "GPU" if device == "cuda" else "CPU host", share)
    for line in format_plan(plan).splitlines():
        log.info("plan | %s", line)
    return plan


def _checkpoint_size(path: Path) -> str:
    from specdeploy.engine.models.checkpoint import Checkpoint

    return Checkpoint(path).describe()


def _param_bytes(module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _compare(what: str, measured: int, planned: int) -> None:
    diff = (measured - planned) / planned * 100 if planned else float("inf")
    level = logging.WARNING if abs(diff) > 10 else logging.INFO
    log.log(level, "plan check: %s %s measured vs %s planned (%+.1f%%)",
            what, human_bytes(measured), human_bytes(planned), diff)


def _fit_prefill_chunk(runner, plan, available_bytes: int) -> None:
    """Shrink the prefill chunk if the memory left after start-up cannot hold the plan's
    workspace (another term took more than planned); refuse to start if not even a small chunk
    fits, rather than run out of memory on the first long prompt."""
    from specdeploy.engine.planner.plan import MIN_PREFILL_CHUNK_TOKENS, prefill_chunk_that_fits

    workspace = plan.memory_per_gpu.activation_workspace_bytes
    chunk = prefill_chunk_that_fits(available_bytes, workspace, runner.prefill_chunk_tokens)
    if chunk == runner.prefill_chunk_tokens:
        return
    if chunk == 0:
        raise RuntimeError(
            f"only {available_bytes / 2**30:.2f} GiB of GPU memory is left after loading and graph "
            f"capture; the plan's prefill workspace needs {workspace / 2**30:.2f} GiB and even a "
            f"{MIN_PREFILL_CHUNK_TOKENS}-token chunk does not fit: lower --max-total-tokens (or the "
            f"resource's context length or concurrency)")
    log.warning("GPU memory left after start-up (%.2f GiB) is less than the plan's prefill workspace "
                "(%.2f GiB): prefill chunk reduced from %d to %d tokens", available_bytes / 2**30,
                workspace / 2**30, runner.prefill_chunk_tokens, chunk)
    runner.prefill_chunk_tokens = chunk


def _warm_library_gemms(runner) -> None:
    """Compile the library GEMMs (DeepGEMM's JIT) the FP8 block-scaled linears take at every
    prefill size up to the chunk, before traffic (models.fp8.warm_library_gemms; nothing to do
    without such linears or such a library). Rank 0's pass: ranks of one pod share the on-disk
    compile cache, so the others load what it compiled."""
    from specdeploy.engine.models import fp8 as fp8_models

    inner = getattr(runner, "runner", runner)  # a tensor-parallel leader wraps rank 0's runner
    fp8_models.warm_library_gemms(inner.target, inner.draft, max_m=inner.prefill_chunk_tokens,
                                  dtype=inner.target.embed_tokens.weight.dtype)


@dataclasses.dataclass(kw_only=True)
class RankSpec:
    """What every rank needs to build its part of the engine (picklable: sent to the workers)."""

    target_dir: str
    draft_dir: str | None
    plan: dict                      # Plan.to_dict(), max_total_tokens as allocated
    dtype: str                      # torch dtype name
    device: str                     # "cuda" | "cpu"
    seed: int
    tp_size: int = 1
    init_method: str = ""
    all_reduce: str = "nccl"
    adaptive: bool = False
    prefix_cache: bool = False
    extend_graphs: bool = False
    role: str = "both"
    random_weights: bool = False
    overlap: bool = True
    launch_ahead: bool = False
    ranks_per_pod: int = 0          # across pods: the ranks (GPUs) of each pod; 0: all of them
    node: str = ""                  # across pods: this pod's node, for log lines

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank % (self.ranks_per_pod or self.tp_size)}" if self.device == "cuda" else "cpu"


def check_plan_for_target(plan, target_config: dict) -> bool:
    """What the engine refuses of a plan for this target before it loads a weight (the rest of
    the plan was checked as it was read); -> whether the target is DeepSeek-V4."""
    from specdeploy.engine.models import deepseek_v4_checkpoint as v4ckpt

    from specdeploy.engine.planner.plan import check_servable

    deepseek_v4 = v4ckpt.is_deepseek_v4_config(target_config)
    check_servable(deepseek_v4, plan.algorithm)
    return deepseek_v4


def build_runner(spec: RankSpec, rank: int = 0, progress=None):
    """Load this rank's shards of target and draft and build its Runner (pools, graphs) from the
    plan; -> (runner, weight bytes held). Under TP every rank calls this with the same spec, and
    the ranks meet at a barrier before the first collective (graph capture, or the first step).
    `progress` (a checkpoint.LoadProgress) counts the weights loaded of the plan's, as they load."""
    import torch

    from specdeploy.engine import parallel
    from specdeploy.engine.models import checkpoint
    from specdeploy.engine.planner.plan import Plan, role_prefill_chunk_tokens
    from specdeploy.engine.runtime import distributed
    from specdeploy.engine.runtime.runner import Runner

    plan = Plan.from_dict(spec.plan)
    dtype = getattr(torch, spec.dtype)
    device = spec.rank_device(rank)
    target_dir, draft_dir = Path(spec.target_dir), spec.draft_dir and Path(spec.draft_dir)
    t0 = time.monotonic()
    shard = f", rank {rank} of {spec.tp_size}" if spec.tp_size > 1 else ""
    log.info("loading target from %s: %s (%s, %s%s)", target_dir,
             "random weights" if spec.random_weights else _checkpoint_size(target_dir), spec.dtype, device, shard)
    from specdeploy.engine.models.llama import read_config

    deepseek_v4 = check_plan_for_target(plan, read_config(str(target_dir)))
    planned_weights = plan.target.weight_bytes_per_gpu + (plan.draft.weight_bytes_per_gpu if plan.draft else 0)
    if progress is not None:
        progress.start(planned_weights)
    try:
        with checkpoint.reporting(progress):
            target, draft, weight_bytes = _load_pair(spec, plan, target_dir, draft_dir, deepseek_v4, dtype, device,
                                                     rank, t0)
    finally:
        if progress is not None:
            progress.finish()
    _compare("weights" + (" (this rank)" if spec.tp_size > 1 else ""), weight_bytes, planned_weights)
    if spec.tp_size > 1:
        parallel.group().barrier()  # loading takes each rank its own time
    t2 = time.monotonic()
    if device.startswith("cuda"):
        calls = "target decode" if plan.algorithm == "NONE" else "the speculative step, greedy and sampling"
        log.info("allocating KV pools and capturing CUDA graphs (%s) for batch sizes %s ...", calls,
                 " ".join(map(str, plan.cuda_graph_batch_sizes)))
    # The runner sizes its pools, tables and graph buffers from the plan (and checks the graph
    # buffers against it); only the slot count may be smaller than planned (load_engine).
    adaptive, prefix_cache = spec.adaptive, spec.prefix_cache
    if adaptive and draft is None:
        raise ValueError("--adaptive-speculation needs a draft; the plan's algorithm is NONE")
    if deepseek_v4 and prefix_cache:
        # Its pools trim a request's recent rows as tokens are committed (compressed_kv.py): a
        # finished request's slots could not be read by the next.
        log.warning("DeepSeek-V4: the prefix cache is off (not supported for its pools yet)")
        prefix_cache = False
    launch_ahead = spec.launch_ahead
    if deepseek_v4 and launch_ahead:
        log.warning("DeepSeek-V4: --launch-ahead is off (its pools are sized for one step in flight)")
        launch_ahead = False
    runner = Runner(target, draft, plan=plan, device=device, seed=spec.seed, adaptive=adaptive,
                    # A decode server takes every prompt from its prefill server: nothing to match.
                    prefix_cache=prefix_cache and spec.role != "decode", role=spec.role,
                    prefill_chunk_tokens=role_prefill_chunk_tokens(spec.role),
                    # A prefill server never decodes: no decode graphs to capture.
                    graph_mode="off" if spec.role == "prefill" else None,
                    overlap=None if spec.overlap else False, launch_ahead=launch_ahead,
                    extend_graphs=spec.extend_graphs)
    if adaptive:
        costs = runner.policy.base_costs_s
        log.info("adaptive speculation: shapes %s; start-up step costs (ms) by batch size: %s",
                 " ".join(s.label for s in runner.shapes),
                 "; ".join(f"{s.label}: " + " ".join(f"{b}={1e3 * costs[(s, b)]:.2f}" for b in runner.policy.buckets)
                           for s in runner.shapes))
    kv_bytes = runner.target_kv.nbytes + (runner.draft_kv.nbytes if runner.draft_kv is not None else 0)
    log.info("KV pools allocated: %d token slots, %s (target + draft)", plan.max_total_tokens, human_bytes(kv_bytes))
    if device.startswith("cuda"):
        log.info("CUDA graphs captured for %d batch sizes in %.1f s", len(plan.cuda_graph_batch_sizes),
                 time.monotonic() - t2)
    else:
        log.info("CUDA graphs: none on CPU; the same calls run eagerly")
    _compare("KV cache", kv_bytes, plan.max_total_tokens * plan.memory_per_gpu.kv_cache_bytes_per_token)
    if spec.tp_size > 1:
        distributed.agree_on_shapes(runner, parallel.group())
    return runner, weight_bytes


def _load_pair(spec: RankSpec, plan, target_dir: Path, draft_dir: Path | None, deepseek_v4: bool, dtype,
               device: str, rank: int, t0: float):
    """-> (target, draft or None, weight bytes held), each logged with its size and time."""
    from specdeploy.engine.models import deepseek_v4_checkpoint as v4ckpt
    from specdeploy.engine.models.draft import load_draft

    if deepseek_v4:
        target = v4ckpt.load_v4_target(str(target_dir), dtype, device, tp_rank=rank, tp_size=spec.tp_size)
    else:
        target = _load_or_random_target(spec, target_dir, dtype, device, rank)
    weight_bytes = _param_bytes(target)
    log.info("target loaded: %d layers, %s in %.1f s", target.cfg.num_layers, human_bytes(weight_bytes),
             time.monotonic() - t0)
    draft = None
    if plan.algorithm != "NONE":
        t1 = time.monotonic()
        log.info("loading %s draft from %s: %s", plan.algorithm, draft_dir,
                 "random weights" if spec.random_weights else _checkpoint_size(draft_dir))
        if deepseek_v4:
            draft = v4ckpt.load_v4_mtp(str(draft_dir), target, dtype, device)
        else:
            draft = (_random_draft(spec, draft_dir, plan, target, dtype, device, rank) if spec.random_weights
                     else load_draft(str(draft_dir), plan.algorithm, target, dtype, device))
        if plan.draft.quantized_at_load != "none":
            from specdeploy.engine.models import fp8

            converted = fp8.quantize_draft(draft, plan.draft.quantized_at_load)
            log.info("draft: %d linears quantized to %s as planned (e4m3, %s block scales); its other weights stay %s",
                     len(converted), plan.draft.quantized_at_load, "x".join(map(str, fp8.DRAFT_FP8_FORMAT.block)),
                     str(dtype).removeprefix("torch."))
        weight_bytes += _param_bytes(draft)
        log.info("draft loaded: %d layer(s), %s in %.1f s", draft.cfg.num_layers,
                 human_bytes(_param_bytes(draft)), time.monotonic() - t1)
    return target, draft, weight_bytes


def _load_or_random_target(spec: RankSpec, target_dir: Path, dtype, device: str, rank: int):
    from specdeploy.engine.models.llama import ModelConfig, build_target, load_target, random_init_, read_config

    if not spec.random_weights:
        return load_target(str(target_dir), dtype, device, tp_rank=rank, tp_size=spec.tp_size)
    target = build_target(ModelConfig.from_hf(read_config(str(target_dir))), dtype, device,
                          tp_rank=rank, tp_size=spec.tp_size)
    random_init_(target, spec.seed + rank)
    return target


def _random_draft(spec: RankSpec, draft_dir: Path, plan, target, dtype, device: str, rank: int):
    from specdeploy.engine.models.draft import build_draft
    from specdeploy.engine.models.llama import ModelConfig, random_init_, read_config

    raw = read_config(str(draft_dir))
    cfg = ModelConfig.from_hf(raw, allow_any_type=True)
    kwargs = {"draft_vocab_size": int(raw.get("draft_vocab_size") or cfg.vocab_size)} if plan.algorithm == "EAGLE3" else {}
    draft = build_draft(plan.algorithm, cfg, target, dtype, device, **kwargs)
    random_init_(draft, spec.seed + 1000 + rank)
    return draft


def _available_gpu_bytes() -> int:
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info()
    log.info("GPU memory after start-up: %.2f GiB used, %.2f GiB free of %.2f GiB",
             (total_bytes - free_bytes) / 2**30, free_bytes / 2**30, total_bytes / 2**30)
    return free_bytes + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def tp_worker(rank: int, spec: RankSpec) -> None:
    """Rank 1..N-1 of a tensor-parallel engine (a child process of rank 0): load this rank's
    shards, build the same Runner, then run the steps rank 0 sends until it says exit. Any
    failure exits non-zero, which rank 0's watchdog turns into the server's exit."""
    from specdeploy.engine import parallel
    from specdeploy.engine.runtime import distributed

    configure_logging(rank, spec.node)
    distributed.watch_parent()
    try:
        import torch

        torch.manual_seed(spec.seed)
        tp = parallel.init_tp(rank, spec.tp_size, spec.init_method, spec.rank_device(rank), spec.all_reduce)
        runner, _ = build_runner(spec, rank)
        if spec.device == "cuda":
            tp.min_over_ranks(_available_gpu_bytes())
        distributed.follow(runner, tp)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    log.info("tensor-parallel rank %d: exiting", rank)
    end_group_process(0)


def serve_worker_pod(args: argparse.Namespace, group: PodGroup) -> NoReturn:
    """A worker pod of a LeaderWorkerSet group (LWS_WORKER_INDEX > 0): its ranks of the plan,
    no HTTP. Joins the leader, starts its other local ranks, builds its Runner and follows rank
    0's steps until the leader ends the group (exit 0); a lost leader or a failed rank exits 1,
    a group that cannot form exits 1 with one line."""
    import torch

    from specdeploy.engine import parallel
    from specdeploy.engine.runtime import distributed
    from specdeploy.engine.runtime import group as pod_rendezvous

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    ranks = TensorParallelRanks()
    first = None
    try:
        plan, spec, _ = prepare_ranks(args, device, group)
        mine = group.ranks(spec.ranks_per_pod)
        first = mine.start
        configure_logging(first, group.node)
        log.info("group: worker pod %d of %d on node %s: ranks %d..%d of %d; joining the leader %s port %d",
                 group.index, group.size, group.node, mine.start, mine.stop - 1, spec.tp_size,
                 group.leader_address, group.port)
        ranks.pods = member = pod_rendezvous.Member(
            group, spec.ranks_per_pod, lambda lost: ranks.fatal(f"group: lost {lost}: exiting"))
        member.join(args.rendezvous_timeout_s)
        spec = dataclasses.replace(spec, init_method=group.init_method(member.leader_ip))
        ranks.start(spec, range(mine.start + 1, mine.stop))
        tp = parallel.init_tp(first, spec.tp_size, spec.init_method, spec.rank_device(first), spec.all_reduce)
        runner, _ = build_runner(spec, first)
        if device == "cuda":
            tp.min_over_ranks(_available_gpu_bytes())
        log.info("rank %d: following rank 0's steps", first)
        distributed.follow(runner, tp)
    except (GroupError, ValueError, FileNotFoundError) as e:  # one line, then exit 1
        ranks.fatal(str(e))
    except BaseException:
        log.exception("tensor-parallel rank %s failed", first)
        ranks.fatal(f"worker pod {group.index}: stopping")
    log.info("tensor-parallel rank %d: the leader ended the group; exiting", first)
    if ranks.pods is not None:
        ranks.pods.close()
        ranks.pods = None
    if ranks.workers is not None:
        ranks.workers.stop()
    end_group_process(0)


def leave_tp_group() -> bool:
    """Tear down this process's tensor-parallel group before the interpreter exits: a gloo
    group still alive at exit aborts the process (std::terminate from its threads), which
    would turn a clean shutdown into SIGABRT. True when this process was in a group."""
    if "torch" not in sys.modules:
        return False
    from specdeploy.engine import parallel

    if parallel.current() is None:
        return False
    try:
        parallel.destroy_tp()
    except Exception as e:  # noqa: BLE001 - a peer already gone: exit anyway
        log.debug("tensor-parallel group teardown: %s", e)
    return True


def end_group_process(code: int) -> NoReturn:
    """End a process that was in a tensor-parallel group with `code`, now: its group is torn
    down and its logs flushed, and the interpreter's finalization is skipped. Torch's gloo and
    store threads can still be joinable when C++ statics are destroyed, and std::terminate
    then turns a clean exit 0 into SIGABRT (rarely, under load)."""
    leave_tp_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class TensorParallelRanks:
    """Rank 0's handle on the other ranks: starts them, and stops them when the server ends."""

    def __init__(self):
        self.workers = None
        self.leader = None
        self.pods = None  # across pods: group.Leader or group.Member, stopped before the ranks

    def start(self, spec: RankSpec, ranks: range | None = None) -> None:
        """Start `ranks` of this pod (default 1..N-1) as child processes."""
        from specdeploy.engine.runtime import distributed

        ranks = ranks if ranks is not None else range(1, spec.tp_size)
        if not ranks:
            return
        self.workers = distributed.Workers(tp_worker, spec.tp_size, lambda rank: (spec,), ranks=ranks)
        log.info("tensor parallel %d: started ranks %d..%d (pids %s)", spec.tp_size, ranks.start, ranks.stop - 1,
                 " ".join(str(p.pid) for p in self.workers.procs))

    def fatal(self, message: str) -> None:
        from specdeploy.engine.runtime import distributed

        if self.workers is not None:
            self.workers.kill()
        distributed._die(message)

    def stop(self) -> None:
        """After the server stopped (no step runs any more): tell the ranks to exit, reap them.
        Across pods the other pods are told first, so that their exit is not taken for a loss."""
        if self.pods is not None:
            self.pods.close()
            self.pods = None
        if self.workers is None:
            if self.leader is not None:
                with contextlib.suppress(Exception):
                    self.leader.close()
            return
        if self.leader is None:  # loading never finished: nothing to wait for
            self.workers.stop(timeout_s=0)
        else:
            try:
                self.leader.close()
            except Exception:  # a rank already gone: the kill below ends the others
                log.warning("could not tell the tensor-parallel ranks to exit; killing them")
            self.workers.stop()
        self.workers = None


def load_engine(args: argparse.Namespace, metrics, ranks: TensorParallelRanks | None = None, guard=None,
                progress=None):
    """Load models, allocate the plan, warm up; -> (Scheduler, Tokenizer). Runs in a worker thread.
    With a tensor-parallel plan, starts the other ranks through `ranks` first. `progress`: rank 0's
    weights loaded so far (checkpoint.LoadProgress; /health reports it)."""
    import torch

    from specdeploy.engine import parallel
    from specdeploy.engine.runtime import distributed
    from specdeploy.engine.runtime import group as pod_rendezvous
    from specdeploy.engine.runtime.runner import Request
    from specdeploy.engine.serving.scheduler import Scheduler
    from specdeploy.engine.serving.tokenizer import Tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    group = pod_group(port=args.group_port)
    plan, spec, target_dir = prepare_ranks(args, device, group)
    tp_size = plan.tensor_parallel_size
    ranks = ranks or TensorParallelRanks()
    if tp_size > 1:
        if group is not None:
            # Listen before anything slow, so that worker pods find the leader at once.
            ranks.pods = leader = pod_rendezvous.Leader(
                group, spec.ranks_per_pod, lambda lost: ranks.fatal(f"group: lost {lost}: stopping the server"))
        ranks.start(spec, range(1, spec.ranks_per_pod or tp_size))
        if group is not None:
            try:
                nodes = leader.wait_for_workers(args.rendezvous_timeout_s)
            except GroupError as e:  # one line, as the worker pods say theirs, and exit 1
                ranks.fatal(str(e))
            log.info("group: all %d pods joined (leader on node %s; %s)", group.size, group.node,
                     ", ".join(f"worker {i} on {n}" for i, n in sorted(nodes.items())))
        tp = parallel.init_tp(0, tp_size, spec.init_method, spec.rank_device(0), args.all_reduce)
        log.info("tensor parallel %d over %s", tp_size,
                 f"NCCL, all-reduce {tp.all_reduce_backend}" if device == "cuda" else "gloo")
    runner, _ = build_runner(spec, 0, progress)
    if tp_size > 1:
        runner = ranks.leader = distributed.LeaderRunner(runner, tp, ranks.fatal)
    if device == "cuda":
        available = _available_gpu_bytes()
        if tp_size > 1:  # the prefill chunk must be the same on every rank: fit the tightest
            available = tp.min_over_ranks(available)
        _fit_prefill_chunk(runner, plan, available)
        _warm_library_gemms(runner)
    tokenizer = Tokenizer.from_dir(target_dir)
    log.info("tokenizer: %d tokens, end of turn %s, chat template %s, request defaults %s",
             tokenizer.vocab_size, sorted(tokenizer.eos_token_ids) or "none",
             "yes" if tokenizer.chat_template else "none",
             ", ".join(f"{k} {v}" for k, v in tokenizer.sampling_defaults.items()) + " (generation_config.json)"
             if tokenizer.sampling_defaults else "OpenAI's")
    t3 = time.monotonic()
    # One short request through every code path (prefill, draft, verify) before taking traffic:
    # a broken checkpoint fails here, in the log, not on a user's request.
    runner.add(Request(id="warmup", prompt_ids=[0, 1, 2, 3], max_tokens=1 if args.role == "prefill" else 4))
    while runner.has_work:
        runner.step()
    if runner.is_held("warmup"):
        runner.release_held("warmup")
    log.info("warm-up step done in %.2f s", time.monotonic() - t3)

    queued = args.max_queued_requests or QUEUE_PER_RUNNING_REQUEST * plan.max_running_requests
    scheduler = Scheduler(runner, tokenizer, metrics, max_queued_requests=queued,
                          log_interval_s=args.log_interval_s, stall_timeout_s=args.stall_timeout_s)
    inner = getattr(runner, "runner", runner)  # a tensor-parallel leader wraps rank 0's runner
    overlap = ("launch-ahead" if getattr(inner, "launch_ahead", False) else
               "staged" if getattr(inner, "overlap", False) else "off")
    log.info("engine ready: max %d running, %d queued, context %d tokens, %d KV slots, prefix cache %s, "
             "decode overlap %s%s", plan.max_running_requests, queued, plan.context_length, plan.max_total_tokens,
             "on" if runner.prefix_cache is not None else "off", overlap,
             f", tensor parallel {tp_size}" if tp_size > 1 else "")
    if args.role == "both":
        return scheduler, tokenizer
    return scheduler, tokenizer, disaggregation_service(args, scheduler, plan, guard)


def prepare_ranks(args: argparse.Namespace, device: str, group: PodGroup | None):
    """What every rank of this server builds from: the models' directories (downloaded if need
    be), the plan (read or made here, checked against this pod), the RankSpec; -> (plan, spec,
    target directory). The same on every pod of a group, from the same arguments."""
    from specdeploy.engine.runtime import distributed

    if args.plan:
        # Refuse before any download: a plan for more GPUs than the pod has would otherwise
        # fetch the whole checkpoint (131 GiB for a 70B target) only to stop later.
        planned = json.loads(Path(args.plan).read_text())
        _check_gpus((args.tensor_parallel_size or planned.get("tensor_parallel_size", 1))
                    // planned.get("nodes", 1), device)
    target_dir = resolve_model_path(args.target, args.target_revision)
    draft_dir = resolve_model_path(args.draft, args.draft_revision) if args.draft else None
    plan = make_plan(args, target_dir, draft_dir, device, group.size if group is not None else 1)
    if args.plan:
        # A plan made elsewhere still goes through the pair check before a weight is read (a
        # plan computed here went through it in plan_from_configs).
        from specdeploy.engine.models.llama import read_config
        from specdeploy.engine.planner.plan import check_pair

        check_pair(plan.algorithm, read_config(str(target_dir)),
                   read_config(str(draft_dir)) if draft_dir and draft_dir != target_dir else None)
    if plan.algorithm == "MTP" and draft_dir is None:
        draft_dir = target_dir  # MTP layers ship inside the target's checkpoint
    if plan.algorithm != "NONE" and draft_dir is None:
        raise ValueError(f"the plan's algorithm is {plan.algorithm}: give its draft with --draft")
    tp_size = plan.tensor_parallel_size
    check_group(plan, group)
    _check_gpus(tp_size // plan.nodes, device)
    dtype = _torch_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    if args.role != "both" and plan.target.dtype != dtype_name:
        # The metadata buffer is allocated with the plan's row bytes: another dtype cannot fill it.
        raise ValueError(f"--role {args.role}: the plan is for {plan.target.dtype} and this server computes in "
                         f"{dtype_name} (--dtype {args.dtype}); give --dtype {plan.target.dtype} or a plan "
                         f"made for {dtype_name}")

    max_total_tokens = plan.max_total_tokens
    if args.max_total_tokens is not None and args.max_total_tokens < max_total_tokens:
        max_total_tokens = args.max_total_tokens
        log.info("KV pool: capped at %d token slots by --max-total-tokens (plan: %d)", max_total_tokens,
                 plan.max_total_tokens)
    elif device == "cpu" and not args.plan and plan.required_tokens < max_total_tokens:
        # A plan made here on CPU counts the host's RAM as "GPU memory": the pool gets what the
        # limits need, not all of it. A given --plan is allocated as it is.
        max_total_tokens = plan.required_tokens
        log.info("KV pool: %d token slots on CPU (context %d x %d requests; the plan allows %d)",
                 max_total_tokens, plan.context_length, plan.max_running_requests, plan.max_total_tokens)
    plan = dataclasses.replace(plan, max_total_tokens=max_total_tokens)
    init_method = group.init_method() if group is not None else distributed.free_init_method() if tp_size > 1 else ""
    options = options_from_args(args)
    spec = RankSpec(target_dir=str(target_dir), draft_dir=str(draft_dir) if draft_dir else None,
                    plan=plan.to_dict(), dtype=dtype_name, device=device, seed=args.seed, tp_size=tp_size,
                    init_method=init_method, all_reduce=args.all_reduce, adaptive=options.adaptive_speculation,
                    prefix_cache=options.prefix_cache, extend_graphs=options.extend_graphs, role=args.role, random_weights=bool(args.random_weights),
                    overlap=bool(args.overlap), launch_ahead=bool(args.launch_ahead),
                    ranks_per_pod=tp_size // plan.nodes if group is not None else 0,
                    node=group.node if group is not None else "")
    return plan, spec, target_dir


def check_group(plan, group: PodGroup | None) -> None:
    """A plan of N nodes runs on the N pods of one LWS group, and a group runs such a plan."""
    pods = group.size if group is not None else 1
    if plan.nodes != pods:
        where = f"LWS_GROUP_SIZE is {pods}" if group is not None else "this pod is not part of a LeaderWorkerSet group (LWS_* not set)"
        raise ValueError(f"the plan spans {plan.nodes} node(s) and {where}")
    if plan.tensor_parallel_size % pods:
        raise ValueError(f"tensor_parallel_size {plan.tensor_parallel_size} does not divide over {pods} pods")


def disaggregation_service(args: argparse.Namespace, scheduler, plan, guard=None):
    """The split roles: a Mooncake agent with the KV pools and the metadata buffer registered,
    and the role's service (engine/serving/disagg/)."""
    from specdeploy.engine.runtime.transfer import MooncakeAgent
    from specdeploy.engine.serving.disagg.protocol import DEFAULT_PREFILL_TIMEOUT_S, server_info

    runner = scheduler.runner
    staged = args.transfer_staging != "off"
    if not staged and runner.device.type != "cpu":
        raise RuntimeError("--transfer-staging off: this Mooncake build registers host memory only")
    if not staged and not runner.slot_row_pools:
        raise RuntimeError("--transfer-staging off: DeepSeek-V4's KV pools move only through a staging arena")
    if not staged and plan.tensor_parallel_size > 1:
        raise RuntimeError("--transfer-staging off: under tensor parallelism the KV moves only through a staging arena")
    host = args.transfer_host or _host_address()
    arena = _staging_arena(runner, plan) if staged else None
    agent = MooncakeAgent(host, args.transfer_protocol)
    if staged:
        agent.register(arena.buffer)
    else:  # peers read and write the pools themselves
        for pool in runner.kv_pools():
            agent.register(pool.k)
            agent.register(pool.v)
    for tensor in runner.metadata.tensors:
        agent.register(tensor)
    info = server_info(args.role, args.served_model_name or args.target, runner, agent.session_id,
                       plan.tensor_parallel_size)
    rows, width = runner.metadata.hidden.shape
    log.info("%s role: Mooncake %s session %s; metadata buffer [%d, %d] %s (%s) registered; KV rows %s",
             args.role, args.transfer_protocol, agent.session_id, rows, width, info.dtype,
             human_bytes(runner.metadata.nbytes),
             f"through a {human_bytes(arena.nbytes)} staging arena{' (pinned)' if arena.buffer.is_pinned() else ''}, "
             "one region and one batched write per request" if staged else "written pool to pool")
    if args.role == "prefill":
        from specdeploy.engine.serving.disagg.prefill import PrefillService

        return PrefillService(scheduler, agent, info, arena)
    from specdeploy.engine.serving.auth import disagg_headers
    from specdeploy.engine.serving.disagg.decode import DecodeService

    service = DecodeService(scheduler, info, args.prefill_timeout_s or DEFAULT_PREFILL_TIMEOUT_S, agent, arena,
                            peer_headers=lambda: disagg_headers(guard))
    scheduler.remote = service
    return service


def _staging_arena(runner, plan):
    """The plan's transfer staging arena (host memory, pinned on a GPU), grown with a warning if
    it cannot hold one context-length request of this runner's pools (the plan counted other KV
    bytes per token: the `plan check: KV cache` line says so too)."""
    from specdeploy.engine.planner.plan import TRANSFER_STAGING_REQUESTS, staging_aligned
    from specdeploy.engine.runtime.transfer import StagingArena

    need = staging_aligned(runner.staged_kv(plan.context_length).nbytes)
    # Plans written before the staging term existed have none: size it as the planner does.
    planned = plan.buffers.transfer_staging_bytes or TRANSFER_STAGING_REQUESTS * need
    if planned < need:
        log.warning("the plan's transfer staging (%s) cannot hold one %d-token request of these KV pools (%s): "
                    "allocating %s", human_bytes(planned), plan.context_length, human_bytes(need),
                    human_bytes(TRANSFER_STAGING_REQUESTS * need))
        planned = TRANSFER_STAGING_REQUESTS * need
    return StagingArena(planned, pin=runner.device.type == "cuda")


def _host_address() -> str:
    """This host's address as peers see it (the pod IP in a cluster); loopback, with a warning,
    where the hostname does not resolve (peers on other hosts cannot reach it: --transfer-host)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        log.warning("this host's name %r does not resolve (%s): the transfer engine listens on 127.0.0.1, "
                    "reachable from this host only; give --transfer-host", socket.gethostname(), e)
        return "127.0.0.1"
