"""The benchmark suite's one entry point.

    python3 bench/run.py --sections 1,2,3,4,6 --out RUN1     # ~6 min on an H200
    python3 bench/run.py --sections 5 --out RUN2             # ~2.5 min
    python3 bench/run.py --sections 5,7 --out RUN3           # ~5 min: 5, then its pair at the 8B cost
    python3 bench/run.py --smoke                             # every section, CPU, tiny shapes
    python3 bench/report.py RUN1 RUN2                        # -> docs/benchmarks.md

The package need not be installed: common.bootstrap_specdeploy() imports specdeploy.engine from
this checkout.

Sections (issue 8): 1 roofline, 2 target-only decode, 3 speculative step costs, 4 CUDA graphs vs
eager, 5 real acceptance (trained target + EAGLE head), 6 planner truth; (issue 19) 7 the trained
pair of section 5 embedded exactly in Llama-3.1-8B shapes, end to end, and the batch sweep of
adaptive speculation (`--sections 5,7` reuses section 5's training; alone, 7 trains its own). Each writes
<out>/<n>_<name>.json as soon as it ends; a failing section is recorded with its traceback and the
suite goes on. Sections run in the order 6, 1, 4, 3, 2, 5 whatever order they are given in: the
planner first, in a process that holds nothing else yet (it fills the GPU with the plan's KV
pool, as the engine does); section 2 late, because transformers' own compile is the one step
whose duration nobody bounds (the engine's figures are saved before it starts); training last,
with the GPU to itself. A short summary table is printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works under python3 -P too

from common import bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import torch  # noqa: E402

from common import (LLAMA_31_8B, TINY_LLAMA, catalog_gpu, copy_bandwidth_bytes_per_s, environment,  # noqa: E402
                    free_device_memory, log, write_json)

SECTIONS = {
    "1": ("roofline", "Roofline: copy bandwidth, weight and KV bytes, HBM-bound tok/s"),
    "2": ("decode", "Target-only decode: engine vs roofline vs transformers"),
    "3": ("spec_step", "Speculative step costs"),
    "4": ("graphs_vs_eager", "CUDA graphs vs eager"),
    "5": ("acceptance", "Real acceptance: trained target and EAGLE head"),
    "6": ("planner", "Planner truth: planned vs held memory"),
    "7": ("e2e8b", "End to end at the 8B cost: the trained pair embedded in Llama-3.1-8B shapes, "
                   "and adaptive speculation from batch 1 to 64"),
}
ORDER = ("6", "1", "4", "3", "2", "5", "7")

# A hyper-connection (hc_mult 4) target: the Llama-3.1-8B shape with four residual streams
# (spec_hidden_size 16384, float32 mixing weights on every sublayer), so that its figures sit
# beside the hc_mult 1 target's.
HC4_TARGET = {**LLAMA_31_8B, "hc_mult": 4}
TINY_HC4 = {**TINY_LLAMA, "hc_mult": 4}

# Sizes per mode. Device sizes are chosen so that sections 1-4 + 6 fit one call of < 9 minutes
# and section 5 (two training runs against the clock) another.
PROFILES = {
    "device": {
        "target_config": LLAMA_31_8B,
        "hc4_config": HC4_TARGET,
        "context": 1024,
        "batches": (1, 4, 16, 64),
        "warmup": 5,
        "reps": 30,
        "copy_bytes": 4 << 30,
        "matmul_n": 8192,
        "hf_new_tokens": 24,
        "hf_repeats": 3,
        "hf_compiled_batches": (1,),
        "hf_compile": True,
        "graph_batches": (1, 16),
        "runner_steps": 10,
        "runner_warmup": 3,
        "spec_batch": 1,
        "spec_steps": 10,
        "spec_warmup": 3,
        "eagle3_draft_vocab": 32000,
        "planner_configs": ("llama8b-none", "llama8b-eagle3-chain", "llama8b-eagle-tree", "hc4-mtp-chain"),
        "gpu": "h200",
    },
    "smoke": {
        "target_config": TINY_LLAMA,
        "hc4_config": TINY_HC4,
        "context": 32,
        "batches": (1, 2),
        "warmup": 1,
        "reps": 2,
        "copy_bytes": 8 << 20,
        "matmul_n": 256,
        "hf_new_tokens": 3,
        "hf_repeats": 1,
        "hf_compiled_batches": (1,),
        "hf_compile": False,
        "graph_batches": (1, 2),
        "runner_steps": 2,
        "runner_warmup": 1,
        "spec_batch": 1,
        "spec_steps": 2,
        "spec_warmup": 1,
        "eagle3_draft_vocab": 128,
        "planner_configs": ("llama8b-none", "llama8b-eagle3-chain", "llama8b-eagle-tree", "hc4-mtp-chain"),
        "gpu": None,  # a custom small GPU: the plan's fixed terms dwarf a tiny model on CPU
    },
}


class Context:
    """What the sections share within one process: the device, the sizes, and models that are
    expensive to make (the 8B target, built once)."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.device = torch.device("cpu" if args.smoke else args.device)
        self.profile = dict(PROFILES["smoke" if args.smoke else "device"])
        if self.profile["gpu"] and self.device.type == "cuda":
            self.profile["gpu"] = catalog_gpu(self.device)
        self.profile.update(_overrides(args))
        self.dtype = torch.bfloat16
        self.args = args
        self._target = None
        self.trained_pair = None  # section 5's trained target and head, for section 7
        self._bandwidth = None
        self.partial = lambda results: None  # set per section by _run_section

    def __getitem__(self, key):
        return self.profile[key]

    def target(self):
        if self._target is None:
            from harness import random_target

            t0 = time.perf_counter()
            self._target = random_target(self["target_config"], self.device, self.dtype)
            log(f"target built: {sum(p.numel() for p in self._target.parameters()) / 1e9:.2f} B "
                f"params, random {self.dtype}, {time.perf_counter() - t0:.1f} s")
        # Target-only by default: a speculative Runner of an earlier section may have switched
        # on the draft feature (EAGLE-3 concatenates three layers' states on every forward).
        self._target.set_feature(None)
        return self._target

    def bandwidth(self) -> float:
        if self._bandwidth is None:
            self._bandwidth = copy_bandwidth_bytes_per_s(self["copy_bytes"], self.device)
            log(f"copy bandwidth {self._bandwidth / 1e12:.3f} TB/s")
        return self._bandwidth

    def release(self) -> None:
        self._target = None
        try:  # transformers' compiled decode (section 2) keeps graphs and their memory alive
            torch._dynamo.reset()
        except Exception:  # nothing compiled, or no dynamo: nothing to drop
            pass
        free_device_memory()


def _overrides(args) -> dict:
    out = {}
    if args.target_budget_s is not None:
        out["target_budget_s"] = args.target_budget_s
    if args.head_budget_s is not None:
        out["head_budget_s"] = args.head_budget_s
    if args.assistant_budget_s is not None:
        out["assistant_budget_s"] = args.assistant_budget_s
    if args.no_hf_compile:
        out["hf_compile"] = False
    if args.hf_batches:
        out["hf_batches"] = tuple(int(b) for b in args.hf_batches.split(","))
    return out


def _run_section(key: str, ctx: Context, out: Path) -> dict:
    name, title = SECTIONS[key]
    module = __import__(name)
    log(f"=== section {key}: {title}")
    record = {"section": key, "name": name, "title": title, "smoke": ctx.smoke,
              "command": _reproduce_command(key, ctx), "started": time.strftime("%H:%M:%S")}
    t0 = time.perf_counter()

    def save_partial(results: dict) -> None:
        # What a section has so far survives a kill of the whole call.
        write_json(f"{key}_{name}.json", {**record, "status": "partial", "results": results,
                                          "error": "the call ended before the section finished",
                                          "duration_s": round(time.perf_counter() - t0, 1)}, out)

    ctx.partial = save_partial
    try:
        record["results"] = module.run(ctx)
        record["status"] = "ok"
    except Exception as e:  # one failing section must not cost the others their run
        record["status"] = "error"
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        record["traceback"] = traceback.format_exc()[-6000:]
        log(f"section {key} FAILED: {record['error'][:300]}")
    record["duration_s"] = round(time.perf_counter() - t0, 1)
    if ctx.device.type == "cuda":
        record["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    write_json(f"{key}_{name}.json", record, out)
    log(f"=== section {key} {record['status']} in {record['duration_s']} s")
    return record


def _reproduce_command(key: str, ctx: Context) -> str:
    cmd = f"PYTHONUNBUFFERED=1 python3 bench/run.py --sections {key} --out RESULTS_DIR"
    if ctx.smoke:
        cmd += " --smoke"
    return cmd


def _summary(records: list[dict]) -> str:
    lines = ["", "SUMMARY", f"{'section':<12} {'status':<7} {'time':>6}  figures"]
    for r in records:
        figures = ""
        if r["status"] == "ok":
            figures = "; ".join(r["results"].get("summary", []))
        else:
            figures = r.get("error", "")[:200]
        lines.append(f"{r['section'] + ' ' + r['name']:<12} {r['status']:<7} {r['duration_s']:>5.0f}s  {figures}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="1,2,3,4,5,6,7",
                        help="comma-separated section numbers or names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: exercise the code")
    parser.add_argument("--out", default=None, help="output folder (default: $SPECDEPLOY_BENCH_OUT or .bench)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="skip sections that would start after this many seconds")
    parser.add_argument("--target-budget-s", type=float, default=None, help="section 5: target training")
    parser.add_argument("--head-budget-s", type=float, default=None, help="section 5: EAGLE head training")
    parser.add_argument("--assistant-budget-s", type=float, default=None,
                        help="section 5: the assisted-generation draft model's training")
    parser.add_argument("--no-hf-compile", action="store_true", help="section 2: skip transformers' compile")
    parser.add_argument("--hf-batches", default=None,
                        help="section 2: comma-separated batch sizes for transformers (default: all)")
    parser.add_argument("--gemv-table", type=Path, default=None,
                        help="install the small-M linear kernel's launch table from a gemv_table.py that "
                             "bench/gemv_sweep.py wrote (default: the table in engine/kernels/gemv.py)")
    args = parser.parse_args(argv)

    out = Path(args.out or os.environ.get("SPECDEPLOY_BENCH_OUT") or ".bench")
    if args.out:
        os.environ["SPECDEPLOY_BENCH_OUT"] = str(out)
    names = {v[0]: k for k, v in SECTIONS.items()}
    wanted = set()
    for item in args.sections.split(","):
        item = item.strip()
        if not item:
            continue
        key = names.get(item, item)
        if key not in SECTIONS:
            parser.error(f"unknown section {item!r}; known: {', '.join(f'{k} {v[0]}' for k, v in SECTIONS.items())}")
        wanted.add(key)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the device, or pass --smoke")

    if args.smoke:
        torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than the work
    ctx = Context(args)
    t_start = time.perf_counter()
    env = environment()
    env["command"] = " ".join(["python3", "bench/run.py", *(argv if argv is not None else sys.argv[1:])])
    if args.gemv_table is not None:
        import gemv_sweep
        table = gemv_sweep.load_table(args.gemv_table)
        gemv_sweep.install(table)
        env["gemv_table"] = {repr(k): list(v) for k, v in table.items()}
        log(f"installed the gemv table of {args.gemv_table} ({len(table)} entries)")
    write_json("env.json", env, out)
    log(f"device {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"sections {','.join(k for k in ORDER if k in wanted)}{' (smoke)' if args.smoke else ''}")
    records = []
    for key in ORDER:
        if key not in wanted:
            continue
        elapsed = time.perf_counter() - t_start
        if args.time_limit_s is not None and elapsed > args.time_limit_s:
            rec = {"section": key, "name": SECTIONS[key][0], "title": SECTIONS[key][1], "status": "skipped",
                   "error": f"time limit: {elapsed:.0f} s > {args.time_limit_s:.0f} s", "duration_s": 0.0,
                   "smoke": ctx.smoke, "command": _reproduce_command(key, ctx)}
            write_json(f"{key}_{SECTIONS[key][0]}.json", rec, out)
            records.append(rec)
            continue
        if key in ("6", "5", "7"):
            ctx.release()  # the planner fills the GPU; training wants it to itself
        records.append(_run_section(key, ctx, out))
    print(_summary(records), flush=True)
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
