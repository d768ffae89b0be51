"""The plan's DeepSeek-V4 transient (engine/planner/deepseek_v4.py v4_forward_peak_bytes) against
what the engine's forward allocates, at DeepSeek-V4-Flash's width.

The forward runs on the "meta" device (shapes without data, so Flash's 4096-wide, 256-expert
layers cost nothing to hold) under a dispatch mode that follows every tensor the forward creates
(an op's fresh outputs, not its views or in-place results) until its storage is gone: the peak of
their bytes alive at once is the forward's transient, exactly as the code allocates it, before
any allocator rounding (the plan adds PREFILL_ALLOCATOR_SLACK for that). As on the H200: the
hyper-connection and FP4 dequantization kernels' launchers allocate their outputs (the launches
themselves are skipped) and grouped_mm takes its bf16 fast path."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdeploy.engine.models.deepseek_v4 as v4mod
import specdeploy.engine.models.hc as hcmod
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, build_mtp, build_target
from specdeploy.engine.planner.deepseek_v4 import V4ForwardDims, v4_forward_peak_bytes

hck = pytest.importorskip("specdeploy.engine.kernels.hc", reason="needs Triton (the kernels' launchers)")
fp4k = pytest.importorskip("specdeploy.engine.kernels.fp4")
fp4moe = pytest.importorskip("specdeploy.engine.kernels.fp4_moe")

FLASH = Path(__file__).resolve().parents[3] / "manifests" / "models" / "deepseek-v4-flash" / "config.json"
# the plan's formula may count up to this much more than the code holds, never less than 97%
TOLERANCE = (0.97, 1.2)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages the wrapped code creates, alive at once."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # storage -> [bytes, weak refs to the tensors on it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (_, refs) in self.live.items() if all(r() is None for r in refs)]:
            self.now -= self.live.pop(key)[0]
        returns = func._schema.returns
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key in self.live:
                self.live[key][1].append(weakref.ref(t))
            elif i < len(returns) and returns[i].alias_info is None:  # a fresh allocation
                self.live[key] = [t.untyped_storage().nbytes(), [weakref.ref(t)]]
                self.now += self.live[key][0]
        self.peak = max(self.peak, self.now)
        return out


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture
def as_on_h200(monkeypatch):
    monkeypatch.setattr(v4mod, "grouped_mm_without_sync", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(hcmod, "fused_kernels", lambda x, *params, ops: hck)
    monkeypatch.setattr(hck, "_hc_pre_kernel", _NoLaunch())
    monkeypatch.setattr(hck, "_hc_expand_kernel", _NoLaunch())
    # FP4 experts: the fused grouped GEMM (its launcher's outputs), the dequantization kernel otherwise
    monkeypatch.setattr(v4mod, "fused_kernels",
                        lambda x, *params, ops: fp4moe if ops is v4mod.kernels.fp4_moe_ops else fp4k)
    monkeypatch.setattr(fp4k, "_dequant_fp4_kernel", _NoLaunch())
    monkeypatch.setattr(fp4moe, "_fp4_moe_kernel", _NoLaunch())


def flash_layers() -> dict:
    """Flash's width, heads, experts and vocabulary; one layer of each attention kind."""
    c = json.loads(FLASH.read_text())
    c.pop("quantization_config", None)
    c.update(num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], num_hash_layers=1)
    return c


def dims(cfg: V4ModelConfig, quant: str = "") -> V4ForwardDims:
    return V4ForwardDims(cfg.hc_mult, cfg.num_experts, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.num_shared_experts, quant)


def measure(model, tokens: int, prefix: int, hidden=None, requests: int = 1) -> int:
    """Peak transient bytes of one forward of `tokens` new tokens (`requests` prompts of
    tokens / requests each) after `prefix` committed ones."""
    meta = dict(dtype=torch.int64, device="meta")
    b, q = requests, tokens // requests
    kv = model.make_kv(b * (q + prefix) + 8, b * (q + prefix), b, tokens + 8, torch.bfloat16, "meta")
    slots, ids = torch.zeros(b, q, **meta), torch.zeros(b, q, **meta)
    batch = causal_batch(slots, torch.full((b,), q, **meta), torch.zeros(b, prefix, **meta),
                         torch.full((b,), prefix, **meta))
    mode = LiveBytes()
    with torch.no_grad(), mode:
        if hidden is None:
            model(ids, slots, batch, kv)
        else:
            model(ids, hidden, slots, batch, kv)
    return mode.peak


@pytest.fixture(scope="module")
def flash():
    cfg = V4ModelConfig.from_hf(flash_layers())
    target = build_target(cfg, torch.bfloat16, "meta", "mtp")
    return cfg, target


def _closing_queries(monkeypatch):
    """The eager prefill computes entries for the queries that close a window only (a nonzero
    over the chunk, whose size meta cannot know): T / r of them, as real positions give."""
    ratio = {}
    write = v4mod.V4Attention._write_states_and_entries

    def remember(self, x, step, kv):
        ratio["r"] = self.ratio
        return write(self, x, step, kv)

    real_nonzero = torch.Tensor.nonzero

    def nonzero(t, *args, **kwargs):
        if t.device.type != "meta":
            return real_nonzero(t, *args, **kwargs)
        return torch.zeros(t.numel() // ratio["r"], t.dim(), dtype=torch.int64, device="meta")

    monkeypatch.setattr(v4mod.V4Attention, "_write_states_and_entries", remember)
    monkeypatch.setattr(torch.Tensor, "nonzero", nonzero)


@pytest.mark.parametrize("tokens,prefix", [(8192, 0), (2048, 0), (1024, 16384), (256, 4096)],
                         ids=["chunk8192", "chunk2048", "chunk1024-after16k", "chunk256-after4k"])
def test_target_forward_is_what_the_plan_counts(flash, as_on_h200, monkeypatch, tokens, prefix):
    cfg, target = flash
    _closing_queries(monkeypatch)
    measured = measure(target, tokens, prefix)
    planned = max(v4_forward_peak_bytes(cfg.v4, "target", dims(cfg), tokens, prefix, 2).values())
    assert TOLERANCE[0] <= planned / measured <= TOLERANCE[1], (planned, measured)


def test_many_prompts_in_one_chunk(flash, as_on_h200, monkeypatch):
    """32 prompts of 64 tokens: the attention blocks hold QUERY_BLOCK rows over the prompts. The
    formula counts the chunk's entries as one prompt's (its worst case: one long prompt closes
    T / r windows), 32 prompts of 64 close fewer, so it may count up to 1.35x here."""
    cfg, target = flash
    _closing_queries(monkeypatch)
    measured = measure(target, 2048, 1024, requests=32)
    planned = max(v4_forward_peak_bytes(cfg.v4, "target", dims(cfg), 2048, 1024, 2).values())
    assert TOLERANCE[0] <= planned / measured <= 1.35, (planned, measured)


def test_a_captured_step_is_one_block(flash, as_on_h200, monkeypatch):
    """A graph's forward (16 requests verifying 8 nodes each after 4096 tokens) is one block."""
    cfg, target = flash
    monkeypatch.setattr(v4mod, "capturing", lambda t: True)
    measured = measure(target, 128, 4096, requests=16)
    planned = max(v4_forward_peak_bytes(cfg.v4, "target", dims(cfg), 128, 4096, 2, captured=True).values())
    assert TOLERANCE[0] <= planned / measured <= TOLERANCE[1], (planned, measured)


def test_mtp_forward_is_what_the_plan_counts(flash, as_on_h200, monkeypatch):
    cfg, target = flash
    _closing_queries(monkeypatch)
    mtp = build_mtp(target, torch.bfloat16, "meta")
    tokens = 2048
    feature = torch.zeros(1, tokens, cfg.spec_hidden_size, dtype=torch.bfloat16, device="meta")
    measured = measure(mtp, tokens, 0, hidden=feature)
    planned = max(v4_forward_peak_bytes(cfg.v4, "MTP", dims(cfg), tokens, 0, 2).values())
    assert TOLERANCE[0] <= planned / measured <= TOLERANCE[1], (planned, measured)


def test_fp4_experts_in_a_capture_are_what_the_plan_counts(as_on_h200, monkeypatch):
    """FP4 experts as a graph capture computes them (the fused grouped GEMM: no weight copy, the
    rows sorted by expert and the tile map) at verify-sized rows."""
    cfg = V4ModelConfig.from_hf(flash_layers())
    target = build_target(cfg, torch.bfloat16, "meta")
    for m in target.modules():
        if isinstance(m, v4mod._Experts):
            m.quantize("fp4")
    monkeypatch.setattr(v4mod, "capturing", lambda t: True)
    tokens = 128  # 16 requests x 8 tree nodes: 768 rows over 256 experts
    measured = measure(target, tokens, 4096)
    planned = max(v4_forward_peak_bytes(cfg.v4, "target", dims(cfg, "fp4"), tokens, 4096, 2).values())
    assert TOLERANCE[0] <= planned / measured <= TOLERANCE[1], (planned, measured)
