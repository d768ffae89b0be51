"""`specdeploy plan`: print the memory plan for a target + draft on one node's GPUs, or on several
nodes' (--max-nodes: tensor parallel across them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdeploy.engine.planner.plan import (
    GIB,
    GPUS,
    Limits,
    Plan,
    SERVER_ROLES,
    PlanError,
    SpecSettings,
    TRANSFER_STAGING_REQUESTS,
    custom_gpu,
    plan_from_configs,
)
from specdeploy.engine.planner.remote import is_hub_id, load_hub_model
from specdeploy.engine.planner.errors import PLANNER_FAILED
from specdeploy.engine.planner.options import add_arguments, default_context_length, model_max_context
from specdeploy.engine.planner.shapes import ALGORITHMS, ConfigError
from specdeploy.engine.planner.weights import UNUSED_HEAD_TENSORS, CheckpointWeights, load_model

# The EngineOptions a plan depends on (the others are the engine's own).
PLAN_OPTIONS = ("num_steps", "topk", "num_draft_tokens", "draft_quantization", "max_running_requests", "context_length",
                "kv_cache_dtype")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="plan GPU memory for a target + draft model",
        description="Derive both models' shapes from config.json and plan per-GPU memory: weights, "
        "KV cache, CUDA-graph and disaggregation buffers, tensor-parallel size, max_total_tokens.",
    )
    parser.add_argument("-f", "--filename", metavar="FILE",
                        help="a SpecDecodeDeployment (YAML or JSON): plan it as the operator does (its defaults, "
                        "its config and hub reads); prints the plan.json the operator would write")
    parser.add_argument("--target-config", metavar="PATH",
                        help="with -f: this config.json in place of spec.target's source (as if given inline)")
    parser.add_argument("--draft-config", metavar="PATH",
                        help="with -f: this config.json in place of spec.draft's source (as if given inline)")
    parser.add_argument("--target", metavar="PATH",
                        help="config.json, a model directory (config.json + *.safetensors or pytorch_model*.bin), or a hub id ORG/NAME "
                        "(config.json and safetensors headers read from the hub, no weights downloaded)")
    parser.add_argument("--draft", metavar="PATH",
                        help="the draft's config.json, directory or hub id (required for EAGLE/EAGLE3; MTP defaults to the target's own layers)")
    parser.add_argument("--hub-endpoint", metavar="URL", help="hub for ORG/NAME ids (default $HF_ENDPOINT or https://huggingface.co; token from $HF_TOKEN)")
    parser.add_argument("--target-revision", default="main", metavar="REV", help="hub revision of the target (default main)")
    parser.add_argument("--draft-revision", default="main", metavar="REV", help="hub revision of the draft (default main)")
    parser.add_argument("--algorithm", type=_algorithm, metavar="{" + ",".join(ALGORITHMS) + "}",
                        help="speculative algorithm (any case; required without -f)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", type=_gpu, default="h200", metavar="{" + ",".join(sorted(GPUS)) + "}",
                     help="GPU model (any case; default h200); others: --gpu-memory-gib")
    gpu.add_argument("--gpu-memory-gib", type=float, metavar="X", help="GPU memory in GiB, for GPUs outside the catalog")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs one node offers (default 8)")
    parser.add_argument("--max-nodes", type=int, default=1, metavar="N",
                        help="the most nodes one replica may span, tensor parallel across all their GPUs; "
                             "the plan takes the fewest that fit (default 1)")
    add_arguments(parser, PLAN_OPTIONS, defaults=True)
    parser.add_argument("--allow-long-context", action="store_true",
                        help="plan a --context-length beyond the target's max_position_embeddings")
    parser.add_argument("--role", choices=SERVER_ROLES, default="both",
                        help="both: one server (default); prefill / decode: one half of a disaggregated pair "
                             "(no graphs / a small prefill workspace, and a host staging arena for the transfers)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (the operator's plan.json)")
    parser.set_defaults(func=run)
    return parser


def _algorithm(text: str) -> str:
    name = text.upper()
    if name not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(ALGORITHMS)}")
    return name


def _gpu(text: str) -> str:
    name = text.lower()
    if name not in GPUS:
        raise argparse.ArgumentTypeError(f"{text!r} is not in the catalog ({', '.join(sorted(GPUS))}); "
                                         "for another GPU give its memory with --gpu-memory-gib")
    return name


def run(args: argparse.Namespace) -> int:
    if args.filename:
        given = [flag for flag, value in (("--target", args.target), ("--draft", args.draft),
                                          ("--algorithm", args.algorithm)) if value]
        if given:
            print(f"specdeploy plan: {', '.join(given)}: not used with -f (the resource names them)", file=sys.stderr)
            return 2
        # Planning a resource is the operator's planning (operator/plan_file.py); the command
        # line hands it over (specdeploy/cli.py), so this package never imports the operator.
        return args.plan_resource(args)
    if args.target_config or args.draft_config:
        print("specdeploy plan: --target-config / --draft-config: only with -f", file=sys.stderr)
        return 2
    if not args.target or not args.algorithm:
        print("specdeploy plan: --target and --algorithm are required (or -f RESOURCE)", file=sys.stderr)
        return 2
    try:
        result = _plan(args)
    except (ConfigError, PlanError) as err:
        print(f"specdeploy plan: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a config nobody foresaw: one line, as the operator says it
        print(f"specdeploy plan: {PLANNER_FAILED}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0


def _plan(args: argparse.Namespace) -> Plan:
    if args.algorithm in ("EAGLE", "EAGLE3") and not args.draft:
        raise ConfigError(f"--draft: required for algorithm {args.algorithm}")
    if args.algorithm == "NONE" and args.draft:
        raise ConfigError("--draft: not used with algorithm NONE")
    target_config, target_weights = _load(args.target, args.target_revision, args.hub_endpoint)
    draft_config, draft_weights = (_load(args.draft, args.draft_revision, args.hub_endpoint, UNUSED_HEAD_TENSORS)
                                   if args.draft else (None, None))
    gpu = custom_gpu(args.gpu_memory_gib) if args.gpu_memory_gib is not None else GPUS[args.gpu]
    if args.algorithm == "NONE":
        spec = SpecSettings("NONE", 0, 0, 0, args.draft_quantization)
    else:
        draft_tokens = args.num_draft_tokens if args.num_draft_tokens is not None else args.num_steps + 1
        spec = SpecSettings(args.algorithm, args.num_steps, args.topk, draft_tokens, args.draft_quantization)
    limits = Limits(args.max_running_requests, _context_length(args, target_config), args.max_running_requests)
    return plan_from_configs(
        target_config, draft_config, spec, gpu, limits,
        target_weight_bytes=target_weights.total_bytes if target_weights else None,
        draft_weight_bytes=draft_weights.total_bytes if draft_weights else None,
        target_weight_source=target_weights.source if target_weights else None,
        draft_weight_source=draft_weights.source if draft_weights else None,
        gpus_per_node=args.gpus_per_node, kv_cache_dtype=args.kv_cache_dtype, role=args.role,
        max_nodes=args.max_nodes,
    )


def _context_length(args: argparse.Namespace, target_config: dict) -> int:
    """--context-length, refused beyond the target's max_position_embeddings unless asked for;
    by default the smaller of the two."""
    if args.context_length is None:
        return default_context_length(target_config)
    limit = model_max_context(target_config)
    if limit is not None and args.context_length > limit and not args.allow_long_context:
        raise ConfigError(f"--context-length {args.context_length}: longer than the target's "
                          f"max_position_embeddings {limit}; pass --allow-long-context to plan it anyway")
    return args.context_length


def _load(path: str, revision: str, endpoint: str | None,
          unused: tuple[str, ...] = ()) -> tuple[dict, CheckpointWeights | None]:
    """A local config.json or model directory; else, when `path` reads as ORG/NAME, the hub's."""
    if not Path(path).exists() and is_hub_id(path):
        return load_hub_model(path, revision, endpoint=endpoint)
    return load_model(path, unused)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(p: Plan) -> str:
    """The human table: every term of the plan with its value."""
    m, b = p.memory_per_gpu, p.buffers
    rows: list[tuple[str, str]] = [
        ("algorithm", f"{p.algorithm}" + (f" (steps {p.num_steps}, topk {p.topk}, draft tokens {p.num_draft_tokens})" if p.draft else "")),
        ("gpu", f"{p.gpus_per_node} x {p.gpu} ({_gib(m.gpu_memory_bytes)} each){' ' + p.gpu_product_label if p.gpu_product_label else ''}"),
        ("nodes", f"{p.nodes}" + (f" x {p.gpus_per_node_used} GPUs, one tensor-parallel group across them" if p.nodes > 1 else "")),
        ("spec_hidden_size", f"{p.spec_hidden_size} (hidden {p.target.hidden_size} x hc_mult {p.target.hc_mult})"),
        ("draft_input_hidden_size", str(p.draft_input_hidden_size)),
        ("tensor_parallel_size", str(p.tensor_parallel_size)),
        ("max_total_tokens", f"{p.max_total_tokens} (needs {p.required_tokens} = {p.context_length} context x {p.max_running_requests} requests)"),
    ]
    for label, t in (("target", p.target), ("draft", p.draft)):
        if t is None:
            continue
        rows += [
            (label, f"{t.architecture or t.model_type} as {t.role}, {t.dtype}, {t.num_layers} layer{'s' if t.num_layers != 1 else ''}, {t.attention} attention"),
            ("  params / weights", f"{t.num_params / 1e9:.3f} B / {_gib(t.weight_bytes)} (from {t.weight_source}"
                                   + (f", linears quantized to {t.quantized_at_load} at load" if t.quantized_at_load != "none" else "")
                                   + f"), {_gib(t.weight_bytes_per_gpu)} per GPU"),
            ("  KV bytes per token", f"{t.kv_cache_bytes_per_token} ({t.kv_cache_bytes_per_token_per_gpu} per GPU)"
                                     + (f", {t.kv_cache_dtype}" if t.kv_cache_dtype != "auto" else "")),
        ]
        if t.kv_cache_bytes_per_request_per_gpu:
            rows.append(("  KV bytes per request", f"{t.kv_cache_bytes_per_request_per_gpu} (recent-token rows: windows, compressor state; per GPU)"))
        if t.kv_cache_bytes_per_in_flight_token_per_gpu:
            rows.append(("  KV bytes per in-flight slot", f"{t.kv_cache_bytes_per_in_flight_token_per_gpu} (a row in every pool; per GPU)"))
    rows += [
        ("buffers (cuda_graph_max_bs)", str(b.max_bs)),
        ("  draft hidden_states", str(list(b.draft_hidden_states_shape))),
        ("  draft-extend hidden_states", str(list(b.draft_extend_hidden_states_shape))),
        ("  verify hidden_states", str(list(b.verify_hidden_states_shape))),
        ("  cuda_graph_hidden_states_bytes", str(b.cuda_graph_hidden_states_bytes)),
        ("  metadata per request", f"{b.metadata_hidden_states_bytes_per_request} hidden + {b.metadata_fixed_fields_bytes_per_request} fixed bytes"),
    ]
    if b.transfer_staging_bytes:
        rows.append(("  transfer staging (host)", f"{_gib(b.transfer_staging_bytes)} ({TRANSFER_STAGING_REQUESTS} "
                                                  f"context-length requests' KV, one region each)"))
    rows += [
        ("per GPU: memory", _gib(m.gpu_memory_bytes)),
        ("  - weights", _gib(m.weight_bytes)),
        ("  - CUDA-graph pool", _gib(m.cuda_graph_pool_bytes)),
        ("  - activation workspace", _gib(m.activation_workspace_bytes)),
        ("  - static buffers", _gib(m.static_buffer_bytes)),
        ("  - per-request state", _gib(m.per_request_state_bytes)),
        ("  - reserve", _gib(m.reserve_bytes)),
        ("  = KV budget", _gib(m.kv_cache_budget_bytes)),
        ("  / KV bytes per token", f"{m.kv_cache_bytes_per_token} (target + draft)"),
        ("cuda_graph_batch_sizes", " ".join(map(str, p.cuda_graph_batch_sizes))),
    ]
    rows += [("note", note) for note in p.notes]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
