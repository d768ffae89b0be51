"""`specdeploy engine serve`: its flags, their checks, and the command that runs the server.

The shared options (draft shape, limits, KV dtype, prefix cache) are EngineOptions' fields
(engine/planner/options.py), spelt as `specdeploy plan` spells them. What the server does once
started (the plan, loading, tensor-parallel ranks, pods of a group) is engine/serving/boot.py;
`run` and `ServerThread` (the demo and the tests) both build the server through its `boot`.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

from specdeploy.engine.planner.options import add_arguments
from specdeploy.engine.planner.plan import SERVER_ROLES
from specdeploy.engine.planner.shapes import ALGORITHMS, COMPUTE_DTYPES
from specdeploy.engine.runtime.group import GROUP_PORT, RENDEZVOUS_TIMEOUT_S, GroupError, pod_group
from specdeploy.engine.serving.boot import (QUEUE_PER_RUNNING_REQUEST, boot, configure_logging, end_group_process,
                                            leave_tp_group, log, serve_worker_pod)
from specdeploy.engine.serving.limits import (CONCURRENT_PER_SCHEDULED_REQUEST, DEFAULT_BODY_TIMEOUT_S,
                                              DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                                              DEFAULT_STALL_TIMEOUT_S, MIN_CONCURRENT_REQUESTS)

DTYPES = ("auto", *COMPUTE_DTYPES)
# The shared options' flags default to None (EngineOptions' defaults apply later), so that with
# --plan only what was really given is compared with the plan.
WITH_PLAN = "; with --plan: the plan's"
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    engine = subparsers.add_parser("engine", help="the inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    p = engine_sub.add_parser(
        "serve", help="serve a target (+ draft) model over an OpenAI-compatible API",
        description="Load a target and draft model, allocate the memory plan, and serve "
                    "/v1/completions, /v1/chat/completions, /health, /ready and /metrics.")
    p.add_argument("--target", required=True, help="target model: a local HF-style directory or an HF id in the local HF cache")
    p.add_argument("--draft", help="draft head: a local directory or an HF id (required for EAGLE and EAGLE3)")
    p.add_argument("--target-revision", default="main",
                   help="hub revision (branch, tag or commit sha) of an HF-id --target (default: main)")
    p.add_argument("--draft-revision", default="main",
                   help="hub revision (branch, tag or commit sha) of an HF-id --draft (default: main)")
    # Defaults are None so that, with --plan, only what was really given is compared with the plan.
    p.add_argument("--algorithm", choices=ALGORITHMS, help="default: the plan's, else NONE")
    add_arguments(p, ("num_steps", "topk", "num_draft_tokens", "adaptive_speculation", "draft_quantization"),
                  defaults=False, note=WITH_PLAN)
    p.add_argument("--plan", help="plan.json from the operator; without it the plan is computed here")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    add_arguments(p, ("kv_cache_dtype", "max_running_requests", "context_length"), defaults=False, note=WITH_PLAN)
    p.add_argument("--max-total-tokens", type=int, help="cap the KV pool at this many token slots (default: the plan's)")
    p.add_argument("--gpu-memory-fraction", type=float, default=1.0, metavar="F",
                   help="without --plan: plan for this share of the GPU's memory (default: 1, all of it); "
                        "servers sharing one GPU, such as a prefill and a decode server, each take a share")
    p.add_argument("--max-queued-requests", type=int, help=f"waiting requests before 429 (default: {QUEUE_PER_RUNNING_REQUEST} x max running)")
    p.add_argument("--served-model-name", help="the `model` clients send (default: --target as given)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-timeout-s", type=float, default=600.0,
                   help="SIGTERM: how long in-flight requests may take to finish (the operator passes the pod's "
                        "grace period less its preStop sleep and a margin); a second SIGTERM stops at once")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help=f"a connection whose request headers take longer is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help=f"a request body that takes longer gets 408 (default: {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--max-concurrent-requests", type=int,
                   help="requests in the server at once (read, tokenized, queued or streaming) before 429; the "
                        f"probes and /metrics are not counted (default: {CONCURRENT_PER_SCHEDULED_REQUEST} x "
                        f"(running + queued), at least {MIN_CONCURRENT_REQUESTS})")
    p.add_argument("--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                   help="/ready turns 503 when the queue's head has waited this long while the engine computed "
                        f"nothing (default: {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--log-interval-s", type=float, default=5.0, help="seconds between throughput log lines")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="debug adds tracebacks to start-up failures (which are otherwise one line)")
    p.add_argument("--seed", type=int, default=0)
    add_arguments(p, ("prefix_cache", "extend_graphs"), defaults=False)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="stage the next decode step while the current one runs on the GPU (its "
                        "slots and packed input), waiting for the device once per step; the same "
                        "tokens either way (default: on; --no-overlap for comparison)")
    p.add_argument("--launch-ahead", action="store_true",
                   help="launch the next decode step before waiting for the current one, so the GPU never "
                        "waits for the host between steps (a finished request rides one discarded step; "
                        "one more step of context per request; not with --adaptive-speculation)")
    p.add_argument("--role", choices=SERVER_ROLES, default="both",
                   help="both: prefill and decode here (default); prefill / decode: one half of a "
                        "disaggregated pair behind `specdeploy router` (docs/disaggregation.md)")
    p.add_argument("--transfer-host", help="prefill/decode: the address peers reach this server's transfer "
                                           "engine at (default: this host's address; the pod IP in a cluster)")
    p.add_argument("--transfer-protocol", default="tcp", choices=("tcp", "rdma"),
                   help="prefill/decode: Mooncake transport (default: tcp)")
    p.add_argument("--transfer-staging", choices=("auto", "on", "off"), default="auto",
                   help="prefill/decode: move each request's KV as one region of a host staging arena, one "
                        "batched write (auto, on: the default); off: slot run by slot run between registered "
                        "pools (host memory only: this Mooncake build cannot register GPU memory)")
    p.add_argument("--prefill-timeout-s", type=float, default=None,
                   help="decode: how long a request may wait for its prefill server (default: 120)")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="clients must send `Authorization: Bearer KEY`, KEY one of this file's lines (read "
                        "again when it changes: a mounted Secret rotates in place); /health, /ready and "
                        "/metrics stay open")
    p.add_argument("--disagg-secret-file", metavar="PATH",
                   help="prefill/decode: the secret the router and the split roles share; /disagg/* (and a "
                        "decode server's OpenAI routes) refuse calls without it")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="GPUs (processes) one model is split over (default: the plan's, else 1)")
    p.add_argument("--random-weights", action="store_true",
                   help="random target and draft weights of the checkpoints' shapes instead of reading them "
                        "(a model directory needs only config.json and a tokenizer): start-up and speed checks "
                        "of real shapes without their weights; the text is noise")
    p.add_argument("--group-port", type=int, default=GROUP_PORT,
                   help=f"across pods (LWS_* set): the leader's rendezvous port; torch's store takes the next "
                        f"(default {GROUP_PORT})")
    p.add_argument("--rendezvous-timeout-s", type=float, default=RENDEZVOUS_TIMEOUT_S,
                   help=f"across pods: how long the leader waits for every worker pod, and a worker pod for the "
                        f"leader (default {RENDEZVOUS_TIMEOUT_S:g})")
    p.add_argument("--all-reduce", choices=("nccl", "symm-mem"), default="nccl",
                   help="tensor-parallel all-reduce: NCCL, or PyTorch's symmetric-memory one-shot "
                        "kernel for small messages (CUDA)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specdeploy.engine.serving import startup

    try:
        group = pod_group(port=args.group_port)
    except GroupError as e:
        configure_logging(level=args.log_level)
        log.error("%s", e)
        return 2
    configure_logging(0 if group is not None and group.is_leader else None, group.node if group else "",
                      level=args.log_level)
    try:
        check_args(args)
        guard = serve_guard(args)
        # Before the server listens: a wrong path, an unreachable hub or a mismatched pair is
        # one line and exit 2, never a download followed by a traceback.
        startup.preflight(args)
    except Exception as e:  # noqa: BLE001 - every start-up failure is reported as one line
        return startup.report(e)
    if group is not None and not group.is_leader:
        return serve_worker_pod(args, group)
    booted = boot(args, guard)
    try:
        booted.server.run()
    finally:
        booted.ranks.stop()
        grouped = leave_tp_group()
    if grouped:
        end_group_process(booted.server.exit_code)
    return booted.server.exit_code


def check_args(args: argparse.Namespace) -> None:
    for flag in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "max_concurrent_requests",
                 "stall_timeout_s", "drain_timeout_s"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    from specdeploy.engine.planner.remote import revision_problem

    for flag, model in (("--target", args.target), ("--draft", args.draft)):
        if model is not None and (not model or model.startswith("-")):
            raise ValueError(f"{flag} {model!r}: a model name cannot be empty or start with '-'")
    for flag, revision in (("--target-revision", args.target_revision), ("--draft-revision", args.draft_revision)):
        problem = revision_problem(revision)
        if problem is not None:
            raise ValueError(f"{flag}: {problem}")
    if args.algorithm in ("EAGLE", "EAGLE3") and not args.draft:
        raise ValueError(f"--draft is required for --algorithm {args.algorithm}")
    if args.algorithm == "NONE" and args.draft:
        raise ValueError("--draft given with --algorithm NONE; pick EAGLE, EAGLE3 or MTP")
    # Without --algorithm the plan names it (checked once loaded), else it is NONE.
    if args.adaptive_speculation and (args.algorithm == "NONE" or (args.algorithm is None and not args.plan)):
        raise ValueError("--adaptive-speculation needs a draft (--algorithm EAGLE, EAGLE3 or MTP)")
    if args.launch_ahead and args.adaptive_speculation:
        raise ValueError("--launch-ahead and --adaptive-speculation exclude each other (the policy "
                         "sees each step before choosing the next)")
    if args.launch_ahead and not args.overlap:
        raise ValueError("--launch-ahead is an overlap; drop --no-overlap")
    if args.draft and args.algorithm is None and not args.plan:
        raise ValueError("--draft needs --algorithm (EAGLE, EAGLE3 or MTP) or a --plan that names it")
    if args.prefill_timeout_s is not None and args.role != "decode":
        raise ValueError("--prefill-timeout-s is for --role decode")
    if args.prefill_timeout_s is not None and args.prefill_timeout_s <= 0:
        raise ValueError("--prefill-timeout-s must be > 0")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    if args.plan and args.gpu_memory_fraction != 1:
        raise ValueError("--gpu-memory-fraction is for a plan made here; a --plan was made for its GPU already")


def serve_guard(args: argparse.Namespace):
    """The server's auth.Guard from --api-key-file / --disagg-secret-file (None: open); raises
    ValueError for a file that cannot serve or a secret given to --role both."""
    from specdeploy.engine.serving.auth import guard_from_files

    if args.disagg_secret_file and args.role == "both":
        raise ValueError("--disagg-secret-file is for --role prefill or decode")
    if args.role != "both" and not args.disagg_secret_file:
        log.warning("--role %s without --disagg-secret-file: /disagg/* is open to anyone who reaches this "
                    "port", args.role)
    return guard_from_files(args.api_key_file, args.disagg_secret_file, router_only=args.role == "decode")


class ServerThread:
    """`specdeploy engine serve` in a background thread of this process (the demo, the tests).
    Signals stay with the main thread; `stop()` ends it."""

    def __init__(self, argv: list[str]):
        # Only this module's parser: serving needs none of the other subcommands' imports.
        parser = argparse.ArgumentParser(prog="specdeploy")
        add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        check_args(args)
        booted = boot(args, serve_guard(args))
        self.args, self.state, self.server, self.ranks = args, booted.state, booted.server, booted.ranks
        self.base_url = f"http://{args.host}:{args.port}"
        self._thread = threading.Thread(target=self.server.run, name="engine-server", daemon=True)

    def start(self, timeout_s: float = 300.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.state.ready:
            if self.server.exit_code or not self._thread.is_alive():
                raise RuntimeError(f"the engine failed to start: {self.state.not_ready_reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not ready after {timeout_s} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop serving and release the engine's memory (the KV pools may fill a GPU: a second
        server in this process needs it back)."""
        import gc

        import torch

        self.server.should_exit = True
        self._thread.join(timeout=60)
        self.ranks.stop()
        self.state.scheduler = self.state.tokenizer = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
