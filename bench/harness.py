"""The engine pieces the benchmarks drive: random-weight models built on the device, the
engine's decode call eager or graphed (ModelCalls / GraphedCalls), phase timing of the Runner's
steps, and a bench-captured target forward used only should the engine's graphs fail.

Everything here calls the engine's own code (model, draft heads, KV pool, attention, runner);
the only thing written here is the harness around it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from common import Mark, free_device_memory, is_cuda, log, sync
from specdeploy.engine.models import attention as attention_mod
from specdeploy.engine.runtime import calls as calls_mod
from specdeploy.engine.models.attention import AttnBatch
from specdeploy.engine.models.draft import build_draft
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.models.llama import ModelConfig, build_target, default_dtype

# ---- models ---------------------------------------------------------------------------------


@torch.no_grad()
def random_init_(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights made where the module lives (an 8B model in about a second on the GPU):
    matrices N(0, std), norms near 1, biases small, hyper-connection mixers small (the same
    conventions as engine/demo/toy.py's init). Never zeros: zeros can run faster than real data."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            continue
        if "norm" in name:
            p.normal_(1.0, 0.05, generator=gen)
        elif name.endswith("_hc.fn") or name.endswith("hc_head.fn"):
            p.normal_(0.0, 0.02, generator=gen)
        elif name.endswith(".scale"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".base") or name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)


def random_target(config: dict, device, dtype=torch.bfloat16, feature_kind=None, seed: int = 0):
    cfg = ModelConfig.from_hf(config)
    with default_dtype(dtype):
        model = build_target(cfg, dtype, device, feature_kind)
    random_init_(model, seed)
    return model


def random_head(algorithm: str, draft_config: dict, target, seed: int = 1):
    """An EAGLE / EAGLE-3 / MTP head with random weights, bound to `target`."""
    device = target.embed_tokens.weight.device
    dtype = target.embed_tokens.weight.dtype
    cfg = ModelConfig.from_hf(draft_config, allow_any_type=True)
    kwargs = {}
    if algorithm == "EAGLE":
        kwargs["fc_bias"] = True
    if algorithm == "EAGLE3":
        kwargs["draft_vocab_size"] = int(draft_config.get("draft_vocab_size") or cfg.vocab_size)
    with default_dtype(dtype):
        head = build_draft(algorithm, cfg, target, dtype, device, **kwargs)
    random_init_(head, seed)
    if algorithm == "EAGLE3":
        # d2t: the draft vocabulary is a random subset of the target's, as a trained head's is.
        vd, vt = head.draft_vocab_size, target.cfg.vocab_size
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randperm(vt, generator=gen)[:vd].sort().values
        head.d2t.copy_((ids - torch.arange(vd)).to(device))
        head.t2d.zero_()
        head.t2d[ids.to(device)] = True
    return head


def eagle_head_config(target_config: dict, num_layers: int = 1) -> dict:
    return {**target_config, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": num_layers}


def eagle3_head_config(target_config: dict, draft_vocab_size: int) -> dict:
    return {**target_config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "draft_vocab_size": draft_vocab_size}


def mtp_head_config(target_config: dict) -> dict:
    return {**target_config, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}


def weight_bytes_read_per_step(model) -> int:
    """Bytes a decode step must read from the weights: every parameter except the embedding
    table, of which only the looked-up rows are read (unless tied to the lm_head)."""
    total = 0
    seen = set()
    embed = model.embed_tokens.weight
    lm_head = model.lm_head.weight
    for p in list(model.parameters()) + list(model.buffers()):
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        if p is embed and lm_head is not embed:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed_tokens.weight.element_size()


def use_fast_attention() -> str:
    """The engine's fast attention backend where it exists and runs here, else the reference."""
    try:
        attention_mod.set_backend("fast")
    except Exception as e:  # not written yet, or no Triton: the reference path is what there is
        attention_mod.set_backend("reference")
        log(f"attention: reference backend ({type(e).__name__}: {e})")
    return attention_mod.get_backend()


# ---- a static target forward, capturable in a CUDA graph --------------------------------------


class TargetStep:
    """Fallback when the engine's own graphs fail: the engine's target forward captured here.
    One target forward as a decode (q_len 1) or verify (q_len N, ancestor mask) step: B
    requests, each with a committed prefix of `context` tokens already in the KV pool; writes the
    new tokens' K/V, computes float32 logits and their argmax. All inputs are static tensors, so
    the step can be captured once in a CUDA graph and replayed (the way a serving engine runs
    decode). The pool is filled with random K/V, never zeros."""

    def __init__(self, target, batch_size: int, context: int, q_len: int = 1,
                 mask: torch.Tensor | None = None, kv: KVPool | None = None, seed: int = 0):
        cfg = target.cfg
        dev = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        self.target, self.device = target, dev
        self.batch_size, self.context, self.q_len = batch_size, context, q_len
        per_request = context + q_len
        num_slots = 1 + batch_size * per_request
        if kv is None:
            kv = KVPool(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
            gen = torch.Generator(device=dev).manual_seed(seed)
            kv.k.normal_(generator=gen)
            kv.v.normal_(generator=gen)
        elif kv.k.shape[1] < num_slots:
            raise ValueError(f"KV pool has {kv.k.shape[1]} slots, the step needs {num_slots}")
        self.kv = kv
        base = 1 + torch.arange(batch_size, device=dev)[:, None] * per_request
        prefix = base + torch.arange(context, device=dev)                    # [B, ctx]
        new = base + context + torch.arange(q_len, device=dev)               # [B, Q]
        if mask is None:
            mask = torch.ones(q_len, q_len, dtype=torch.bool, device=dev).tril()
        mask = mask.to(dev).expand(batch_size, q_len, q_len).contiguous()    # [B, Q, Q]
        self.batch = AttnBatch(new, prefix, torch.full((batch_size,), context, device=dev), new, mask)
        depth = mask.sum(-1) - 1                                             # [B, Q] tree depth
        self.positions = (context + depth).to(torch.int64)
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.input_ids = torch.randint(0, cfg.vocab_size, (batch_size, q_len), generator=gen).to(dev)
        self.graph = None
        self.out = None

    def forward(self) -> torch.Tensor:
        out = self.target(self.input_ids, self.positions, self.batch, self.kv)
        return self.target.logits(out.hidden).argmax(-1)                    # [B, Q]

    @torch.inference_mode()
    def run_eager(self) -> None:
        self.out = self.forward()

    @torch.inference_mode()
    def capture(self, pool=None) -> bool:
        """Capture the step in a CUDA graph (False, and eager replay, where there is no CUDA)."""
        if not is_cuda(self.device):
            self.run_eager()
            return False
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: lazy init, cuBLAS handles, autotuning
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.forward()
        return True

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run_eager()


# ---- the engine's decode call, eager or graphed ------------------------------------------------


class EngineDecode:
    """The engine's target decode call for B requests, each with `context` committed tokens in a
    KV pool of random K/V: `ModelCalls.target_decode` (eager) or `GraphedCalls.target_decode`
    (the CUDA graph the Runner replays: inputs copied into its static buffers, one replay).
    `share` reuses another instance's pool and inputs, so eager and graph see the same data."""

    def __init__(self, target, batch_size: int, context: int, graph: bool,
                 share: "EngineDecode | None" = None, seed: int = 0):
        from specdeploy.engine.runtime.calls import ModelCalls

        cfg = target.cfg
        dev = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        if share is None:
            per_request = context + 1
            kv = KVPool(cfg.num_layers, 1 + batch_size * per_request, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
            gen = torch.Generator(device=dev).manual_seed(seed)
            kv.k.normal_(generator=gen)
            kv.v.normal_(generator=gen)
            base = 1 + torch.arange(batch_size, device=dev)[:, None] * per_request
            cpu = torch.Generator(device="cpu").manual_seed(seed + 1)
            ids = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=cpu).to(dev)
            lens = torch.full((batch_size,), context, device=dev)
            self.args = (ids, lens[:, None].clone(), base + context,
                         base + torch.arange(context, device=dev), lens)
            self.kv = kv
        else:
            self.args, self.kv = share.args, share.kv
        self.calls = ModelCalls(target, None, self.kv, None, 0, 1, 1)
        self.graphed = False
        if graph:
            from specdeploy.engine.runtime.graphs import GraphedCalls

            self.graphed = is_cuda(dev)
            with torch.inference_mode():
                self.calls = GraphedCalls(self.calls, (batch_size,), context, capture=self.graphed)
        self.out = None

    @torch.inference_mode()
    def __call__(self) -> None:
        self.out = self.calls.target_decode(*self.args)                      # [B, V] float32


# ---- phase timing of the runner's steps --------------------------------------------------------

@dataclass
class PhaseLog:
    device: object
    marks: list = field(default_factory=list)    # (label, start Mark, end Mark), outermost calls
    depth: int = 0

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = Mark(self.device)
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((label, start, Mark(self.device)))
                self.depth -= 1
        return timed


@contextlib.contextmanager
def instrument(runner):
    """Wrap the runner's model calls (`runner.calls`: ModelCalls, or GraphedCalls replaying CUDA
    graphs) and the tree / acceptance functions between them with timing marks, outermost call
    only. Patches this runner's calls object and the calls module's names, and restores them.
    A fused speculative step (one graph) calls none of them from the host: nothing is marked."""
    log_ = PhaseLog(runner.device)
    calls = runner.calls
    patched = []
    for name, label in (("draft_multi_step", "draft"), ("target_verify", "verify"),
                        ("draft_extend", "extend"), ("target_decode", "decode")):
        if not hasattr(calls, name):
            continue
        patched.append(name)
        setattr(calls, name, log_.wrap(label, getattr(calls, name)))
    saved_funcs = {}
    for name, label in (("build_tree", "tree"), ("verify_greedy", "accept"), ("verify_sampling", "accept")):
        if not hasattr(calls_mod, name):  # renamed in the engine: its time stays in overhead
            continue
        saved_funcs[name] = getattr(calls_mod, name)
        setattr(calls_mod, name, log_.wrap(label, saved_funcs[name]))
    try:
        yield log_
    finally:
        for name in patched:
            del calls.__dict__[name]
        for name, fn in saved_funcs.items():
            setattr(calls_mod, name, fn)


def phase_times(marks, whole_ms: float) -> dict:
    """Split one step's marks into phases (ms): draft (multi-step drafting), verify (the target
    over the tree), extend (the draft over the accepted tokens), decode (plain decode), tree /
    accept (tree building, acceptance); overhead is the rest of the step (index bookkeeping,
    slot alloc/free, host syncs, Python)."""
    out = {f"{k}_ms": 0.0 for k in ("draft", "verify", "extend", "decode", "tree", "accept")}
    for label, start, end in marks:
        out[f"{label}_ms"] += start.ms_until(end)
    out["whole_ms"] = whole_ms
    out["overhead_ms"] = whole_ms - out["draft_ms"] - out["verify_ms"] - out["extend_ms"] - out["decode_ms"]
    return out


def timed_steps(runner, steps: int, warmup: int, device, instrumented: bool) -> list[dict]:
    """Run `warmup` then `steps` runner steps (all requests decoding); per step its wall time
    and, when instrumented, its phases. Stops early when a request finishes."""
    import time

    running = runner.num_running
    results = []
    for i in range(warmup + steps):
        if runner.num_running < running:
            break
        ctx = instrument(runner) if instrumented else contextlib.nullcontext(None)
        with ctx as plog:
            sync(device)
            t0 = time.perf_counter()
            outs = runner.step()
            sync(device)
            whole_ms = (time.perf_counter() - t0) * 1e3
        if i < warmup:
            continue
        rec = phase_times(plog.marks, whole_ms) if plog is not None else {"whole_ms": whole_ms}
        rec["tokens"] = sum(len(o.token_ids) for o in outs)
        rec["accepted"] = sum(o.num_accepted_drafts for o in outs)
        results.append(rec)
    return results


def decode_runner(target, batch: int, context: int, max_new: int, device, graph_mode: str,
                  overlap: bool | None = None, head=None, shape: tuple[int, int, int] | None = None,
                  fused: bool = True, launch_ahead: bool = False):
    """A decode Runner with B requests of a `context`-token prompt each, prefilled: every later
    step() is one decode step for all B (plain; speculative with `head` and shape (steps, topk,
    draft tokens), whose steps may emit up to steps + 1 tokens each), for max_new - 1 steps at least."""
    from specdeploy.engine.planner.plan import PREFILL_CHUNK_TOKENS
    from specdeploy.engine.runtime.runner import Request, Runner
    from specdeploy.engine.planner.plan import SpecSettings

    # the requests prefilled first decode during the later chunks' steps: room for those too
    max_new += -(-batch * context // PREFILL_CHUNK_TOKENS)
    spec, scratch, ahead = None, 1, 2
    if head is not None:
        steps, topk, n = shape
        spec = SpecSettings(head.algorithm, steps, topk, n)
        scratch, ahead = (steps - 1) * topk + n, 2 * (steps + 1)
        max_new *= steps + 1
    runner = Runner(target, head, spec, max_total_tokens=batch * (context + max_new + 2 * scratch + 2) + 8,
                    max_running_requests=batch, context_length=context + max_new + ahead + 8, device=device,
                    cuda_graph_batch_sizes=(batch,), graph_mode=graph_mode, overlap=overlap,
                    fused_spec_step=fused, launch_ahead=launch_ahead)
    gen = torch.Generator().manual_seed(3)
    for i in range(batch):
        prompt = torch.randint(3, target.cfg.vocab_size, (context,), generator=gen).tolist()
        runner.add(Request(f"r{i}", prompt, max_tokens=max_new))
    # Prefill: B x context tokens take several steps of prefill_chunk_tokens each (64 x 1024 is
    # eight); a timed step that still prefilled a chunk measured the prefill, not a decode step.
    runner.step()
    while runner.num_prefilling:
        runner.step()
    return runner


def loop_ms(runner, steps: int, warmup: int, device) -> float:
    """Mean wall time of `steps` back-to-back Runner.step() calls after `warmup`, nothing in
    between (the serving loop: each step waits for its own output, and with overlap has staged
    the next one meanwhile). Raises if a request finished (the batch changed) while timed."""
    import time

    running = runner.num_running
    for _ in range(warmup):
        runner.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    if runner.num_running != running:
        raise RuntimeError("a request finished while the runner's steps were timed")
    return ms


def row_graph_ms(runner, device, reps: int = 20) -> float | None:
    """Median device time of one replay of the graph the runner's last decode step ran (its
    static input still holds that step's rows and slots), the row state restored before each
    replay so that every one does the same work. None without a captured graph. Leaves the
    runner unusable (its host and device state disagree): time this last."""
    steps = runner._row_steps[runner.spec_shape]
    b = runner.num_running
    graph = steps.graphs.get(False) if steps.graphs else None
    entry = graph.graphs.get(graph.bucket(b)) if graph is not None and graph.bucket(b) else None
    if entry is None:
        return None
    st = runner.rows
    saved = [(t, t.clone()) for t in (st.lens, st.roots, st.draft_hidden, st.catch_count) if t is not None]
    times = []
    for i in range(reps + 3):
        for t, v in saved:
            t.copy_(v)
        start = Mark(device)
        entry[0].replay()
        end = Mark(device)
        sync(device)
        if i >= 3:
            times.append(start.ms_until(end))
    return sorted(times)[len(times) // 2]


def runner_overlap_gap(target, batch: int, context: int, steps: int, warmup: int, device, graph_mode: str,
                       head=None, shape=None, call_ms: float | None = None, profile: bool = False,
                       fused: bool = True) -> dict:
    """The Runner's decode step with overlap on (the next step staged while this one runs),
    off, and launch-ahead (the next step launched before this one is waited for), back-to-back
    steps (loop_ms), against the bare replay of the runner's own step graph and, if given, the
    graphed call `call_ms`: the gaps in % are the host work the device still waits for.
    profile: torch.profiler's host-time table of one step in each mode."""
    out = {}
    for key, kw in (("on", dict(overlap=True)), ("off", dict(overlap=False)),
                    ("launch", dict(overlap=False, launch_ahead=True))):
        try:
            runner = decode_runner(target, batch, context, steps + warmup + 12, device, graph_mode,
                                   head=head, shape=shape, fused=fused, **kw)
            out[f"step_ms_overlap_{key}"] = loop_ms(runner, steps, warmup, device)
            out[f"overlapped_steps_{key}"] = runner.num_overlapped_steps / max(runner.num_decode_steps, 1)
            if profile:
                out[f"profile_overlap_{key}"] = profile_top(runner.step, device, reps=5, by="host", top=16)
            if key == "on":
                out["graph_ms"] = row_graph_ms(runner, device)
            del runner
            free_device_memory()
        except Exception as e:  # one mode failing leaves the others' figures
            if key == "on":
                raise
            out[f"error_overlap_{key}"] = f"{type(e).__name__}: {e}"[:300]
            log(f"Runner.step with overlap {key} failed: {out[f'error_overlap_{key}']}")
    base = {"graph": out["graph_ms"], "call": call_ms}
    for name, ms in base.items():
        if ms:
            for key in ("on", "off", "launch"):
                if f"step_ms_overlap_{key}" in out:
                    out[f"gap_pct_overlap_{key}_vs_{name}"] = 100 * (out[f"step_ms_overlap_{key}"] / ms - 1)
    return out


def runner_decode_ms(target, batch: int, context: int, steps: int, warmup: int, device,
                     graph_mode: str) -> float:
    """Median wall time of Runner.step() in plain (non-speculative) decode: B requests with a
    `context`-token prompt each; graph_mode "capture" (the engine's CUDA graphs) or "off"."""
    runner = decode_runner(target, batch, context, steps + warmup + 4, device, graph_mode)
    recs = timed_steps(runner, steps, warmup, device, instrumented=False)
    times = sorted(r["whole_ms"] for r in recs)
    return times[len(times) // 2]


@contextlib.contextmanager
def kernel_env(name: str, value: str):
    """Kernels launched (and graphs captured) inside run with the environment variable `name`
    (one of engine/kernels/launch.py's or fp8_mma.py's, read once and cached there) set to `value`."""
    import os

    from specdeploy.engine.kernels import fp8_mma, launch

    old = os.environ.get(name)
    os.environ[name] = value
    launch.reset()
    fp8_mma.reset()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
        launch.reset()
        fp8_mma.reset()


def pdl_mode(value: str):
    """Under SPECDEPLOY_PDL=value: "0" without programmatic dependent launch, "1" the engine's
    default, "all" PDL after library GEMMs too (engine/kernels/launch.py)."""
    from specdeploy.engine.kernels import launch

    return kernel_env(launch.PDL_ENV, value)


def small_m_kernel(mma: bool):
    """FP8 linears of 1-8 rows on the CUDA mma kernel (engine/kernels/fp8_mma.py, where usable:
    the engine's default) or, mma=False, on the Triton kernel's launches (SPECDEPLOY_FP8_MMA=0)."""
    from specdeploy.engine.kernels import fp8_mma

    return kernel_env(fp8_mma.SWITCH_ENV, "1" if mma else "0")


def pdl_off():
    """Without PDL each kernel starts once its predecessor is done: a profiler's µs per kernel
    are then its own (with PDL a kernel waits in griddepcontrol.wait, booked as its own time),
    so a profile taken inside attributes the step's time per kernel."""
    return pdl_mode("0")


def attributed_profile(target, batch: int, context: int, device, warmup: int, reps: int) -> dict:
    """The graphed decode call at `batch` captured without PDL: its median and a per-kernel
    profile whose µs add up to the step (profile_top), for 'where the time goes' tables."""
    from common import time_ms

    with pdl_off():
        call = EngineDecode(target, batch, context, graph=is_cuda(device))
        t = time_ms(call, device, warmup=warmup, reps=reps)
        prof = profile_top(call, device, reps=10, top=16)
        del call
    free_device_memory()
    return {"batch": batch, "median_ms_pdl_off": t["median_ms"], "profile": prof}


def profile_top(fn, device, reps: int = 5, top: int = 12, by: str = "device") -> dict:
    """Where the time of `fn()` goes, from torch.profiler (CPU + CUDA activities): the ops and
    kernels with the most device time (by="device") or host time (by="host"), summed over `reps`
    calls. Best effort: a machine without a working CUPTI returns the error instead."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(device) else [])
    try:
        fn()
        sync(device)
        with profile(activities=activities) as prof:
            for _ in range(reps):
                fn()
            sync(device)
        events = prof.key_averages()
    except Exception as e:  # profiling is evidence, not a result: never fail a section over it
        return {"error": f"{type(e).__name__}: {e}"[:300]}

    def dev_us(ev):
        return getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0) or 0

    total_dev = sum(dev_us(ev) for ev in events)
    if by == "device":
        rows = sorted(events, key=lambda ev: (dev_us(ev), ev.self_cpu_time_total), reverse=True)[:top]
    else:
        rows = sorted(events, key=lambda ev: ev.self_cpu_time_total, reverse=True)[:top]
    return {
        "reps": reps,
        "by": by,
        "host_time_us_per_call": sum(ev.self_cpu_time_total for ev in events) / reps,
        "device_time_us_per_call": total_dev / reps,
        "top": [{"name": ev.key[:90], "calls_per_rep": ev.count / reps,
                 "self_device_us_per_rep": dev_us(ev) / reps,
                 "self_cpu_us_per_rep": ev.self_cpu_time_total / reps,
                 "share_of_device_time": dev_us(ev) / total_dev if total_dev else None} for ev in rows],
    }
