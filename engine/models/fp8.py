"""FP8 (and FP4-expert) checkpoints: formats, dequantization, and linear layers over FP8 codes.

Checkpoint formats, as config.json's `quantization_config` names them (`fp8_format`):
    fp8 (DeepSeek-V3/V4, Qwen3-*-FP8)    `weight` e4m3 [N, K] + `weight_scale_inv` float32 (or
                                          E8M0 with scale_fmt ue8m0) [ceil(N/bn), ceil(K/bk)]
                                          for weight_block_size [bn, bk]; W = Wq * S per block
    compressed-tensors (RedHatAI FP8)     `weight` e4m3 + `weight_scale` [N, 1] (strategy
                                          channel), [] / [1] (tensor) or a block grid (block);
                                          `input_scale` of static schemes is not needed: the
                                          engine quantizes activations dynamically
    fbgemm_fp8                            `weight` e4m3 + `weight_scale` [N, 1]
Which linears are FP8 is read from the checkpoint itself (a linear whose scale tensor is there),
so embeddings, norms, routers and lm_head stay in the model dtype unless the checkpoint says
otherwise. FP4 experts (DeepSeek-V4: e2m1 pairs in int8 [N, K/2], one E8M0 scale per 32 inputs)
are dequantized by `dequantize_fp4`.

Compute (`fp8_linear`): on CUDA with compute capability >= 8.9 the Triton kernels of
engine/kernels/fp8.py (weight-only for decode, W8A8 with per-token-group activation quantization
for prefill); elsewhere (CPU, tests) the weight is dequantized to the activation dtype and
F.linear runs, so a CPU FP8 model is exactly its dequantized bf16/fp32 twin.

Inside the engine a scale is always a float32 tensor whose rows cover `scale_n` output rows
(the block height, or 1 when fused parts or per-channel scales need a row each) and whose
columns cover 128 inputs (block) or all of K (one column, per channel / per tensor).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specdeploy.engine import kernels
from specdeploy.engine import parallel
from specdeploy.engine.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    fused_kernels,
    materialize,
)
from specdeploy.engine.planner.shapes import DRAFT_QUANTIZATION_BLOCK
from torch import nn

FP8_MAX = 448.0  # largest finite e4m3fn value
KERNEL_BLOCK_K = 128  # the kernels' k tile: block scales must be 128 wide along K to use them
FP4_GROUP = 32
# e2m1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCHEMES = ("block", "channel", "tensor")


@dataclass(frozen=True)
class FP8Format:
    """How a checkpoint stores its FP8 linears."""

    scheme: str  # "block" | "channel" | "tensor"
    scale_name: str  # the scale tensor beside `weight`: "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] = (128, 128)  # (rows, cols) per scale, scheme "block"
    round_scale: bool = False  # ue8m0 checkpoints: activation scales are powers of two
    ignored_suffixes: tuple[str, ...] = ()  # checkpoint tensors the engine does not need


def fp8_format(config: dict) -> FP8Format | None:
    """The FP8 format of a config.json's quantization_config; None when unquantized. A method
    or format the engine cannot compute in is a ValueError naming it."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method", "")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config: fp8 fmt {q.get('fmt')!r} is not supported (e4m3 only)")
        block = q.get("weight_block_size")
        round_scale = q.get("scale_fmt") == "ue8m0"
        if block:
            return FP8Format("block", "weight_scale_inv", (int(block[0]), int(block[1])), round_scale)
        return FP8Format("tensor", "weight_scale_inv", round_scale=round_scale)
    if method == "fbgemm_fp8":
        return FP8Format("channel", "weight_scale")
    if method == "compressed-tensors":
        groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
        if len(groups) != 1:
            raise ValueError(f"quantization_config: compressed-tensors with {len(groups)} weight groups is not supported")
        w = groups[0]["weights"]
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise ValueError(f"quantization_config: compressed-tensors weights {w.get('type')} "
                             f"{w.get('num_bits')}-bit are not supported (FP8 only)")
        strategy = w.get("strategy") or "tensor"
        if strategy not in SCHEMES:
            raise ValueError(f"quantization_config: compressed-tensors strategy {strategy!r} is not supported")
        block = tuple(int(b) for b in (w.get("block_structure") or (128, 128)))
        return FP8Format(strategy, "weight_scale", block, ignored_suffixes=(".input_scale",))
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                     "(fp8, fbgemm_fp8, compressed-tensors FP8)")


# --------------------------------------------------------------------------------------------
# dequantization and quantization (torch; also what the CPU path computes with)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales from float32/bf16 ones or E8M0 ones (float8_e8m0fnu, or their uint8 bits:
    2 ** (bits - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], scale_n: int, block_k: int) -> torch.Tensor:
    """A scale in any of the layouts above, as float32 [N, K] (one value per weight element)."""
    n, k = shape
    s = scale_to_float(scale)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, k)
    if s.dim() == 1 or (s.shape[0] == n and s.shape[1] == 1):
        # one scale per row ([N] or [N, 1]; a grid one block wide with scale_n 1 is the same)
        return s.reshape(-1, 1).expand(n, k)
    return s.repeat_interleave(scale_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 codes [N, K] times their scales -> [N, K] in `dtype`. block: the (rows, cols) each
    scale of a grid covers; per-row ([N] / [N, 1]) and single scales need none."""
    s = expand_scale(scale, tuple(weight.shape), block[0], block[1])
    return (weight.float() * s).to(dtype)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed e2m1 [N, K / 2] (int8 or uint8; element 2j in the low nibble, 2j + 1 in the high)
    with E8M0 scales [N, K / group] -> [N, K] in `dtype`."""
    codes = weight.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    values = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1)
    values = values.reshape(weight.shape[0], -1)
    s = scale_to_float(scale).repeat_interleave(group, 1)[:, :values.shape[1]]
    return (values * s).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]) with each block's
    largest magnitude mapped to 448, as DeepSeek's and Qwen's FP8 checkpoints are made."""
    n, k = w.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    padded = F.pad(w.float(), (0, pk, 0, pn))
    tiles = padded.view((n + pn) // bn, bn, (k + pk) // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)                  # [N / bn, K / bk]
    scale = amax / FP8_MAX
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(n + pn, k + pk)[:n, :k].contiguous(), scale


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes, float32 scales [N, 1]): compressed-tensors' channel strategy."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def act_quant_reference(x: torch.Tensor, group: int = 128, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's dynamic activation quantization in torch: x [M, K] -> (e4m3 [M, K], float32
    scales [M, ceil(K / group)]), s = max(max|x| of the group, 1e-4) / 448 (a power of two
    rounded up for ue8m0), y = x / s. The Triton kernel (kernels.fp8.act_quant) is checked
    against this."""
    m, k = x.shape
    pad = -k % group
    g = F.pad(x.float(), (0, pad)).view(m, (k + pad) // group, group)
    s = g.abs().amax(-1).clamp(min=1e-4) / FP8_MAX
    if round_scale:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    y = (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k + pad)[:, :k]
    return y.contiguous(), s


# --------------------------------------------------------------------------------------------
# compute


@functools.cache
def _kernels_run_on(device_index: int) -> bool:
    # e4m3 tensor-core dots and conversions: Ada (8.9) and Hopper (9.0) onwards.
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int = 128,
               block_k: int = 128, bias: torch.Tensor | None = None, round_scale: bool = False) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T (+ bias) -> [..., N] in x's dtype; weight e4m3 [N, K];
    scale in the engine layout (module docstring), covering scale_n rows x block_k columns."""
    fast = fused_kernels(x, ops=kernels.fp8_ops)
    rows = x.numel() // max(x.shape[-1], 1)
    # A scale per row or per tensor covers all of K whatever block_k says; a grid must be 128 wide.
    per_row = scale.numel() == 1 or scale.dim() == 1 or scale.shape[-1] == 1
    if (fast is not None and rows and (block_k == KERNEL_BLOCK_K or per_row)
            and scale.dtype == torch.float32 and _kernels_run_on(x.device.index or 0)):
        return fast.fp8_linear(x, weight, scale, scale_n, bias, round_scale)
    w = (weight.float() * expand_scale(scale, tuple(weight.shape), scale_n, block_k)).to(x.dtype)
    return F.linear(x, w, bias)


class FP8Linear(nn.Module):
    """A linear layer from FP8 codes and their scales: y = x (weight * scale)^T + bias.

    weight: e4m3 [N, K]; scale: a [ceil(N/bn), ceil(K/bk)] grid for `block` (bn, bk), or [N] /
    [N, 1] per row, or one value; float32, bf16 or E8M0."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                 bias: torch.Tensor | None = None, round_scale: bool = False):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"FP8Linear: weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
        s = scale_to_float(scale)
        per_row = s.numel() > 1 and (s.dim() == 1 or s.shape[-1] == 1)
        self.scale_n, self.block_k = (1, weight.shape[1]) if per_row or s.numel() == 1 else block
        self.round_scale = round_scale
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(s.reshape(-1) if per_row else s, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.scale_n, self.block_k, self.bias,
                          self.round_scale)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (self.weight.float() * expand_scale(self.weight_scale_inv, tuple(self.weight.shape),
                                                   self.scale_n, self.block_k)).to(dtype)


# --------------------------------------------------------------------------------------------
# the engine's parallel linears, over FP8 codes


class _FP8Parallel:
    """State shared by the FP8 parallel linears: the format, the scale parameter (named as the
    checkpoint names it, so load_state routes it) and its layout."""

    fmt: FP8Format
    scale_n: int
    block_k: int

    def _make_fp8_scaled(self, fmt: FP8Format) -> None:
        """_make_fp8 with the scale grid the format implies for this weight [N, K]."""
        n, k = self.weight.shape
        if fmt.scheme == "block":
            bn, bk = fmt.block
            self._make_fp8(fmt, (-(-n // bn), -(-k // bk)), bn)
        elif fmt.scheme == "channel":
            self._make_fp8(fmt, (n,), 1)
        else:
            self._make_fp8(fmt, (1,), 1)

    def _make_fp8(self, fmt: FP8Format, scale_shape: tuple[int, ...], scale_n: int) -> None:
        self.fmt = fmt
        self.scale_n = scale_n
        self.block_k = fmt.block[1] if fmt.scheme == "block" else self.weight.shape[1]
        codes = torch.zeros(self.weight.shape, dtype=torch.float8_e4m3fn, device=self.weight.device)
        self.weight = nn.Parameter(codes, requires_grad=False)
        scale = torch.ones(scale_shape, dtype=torch.float32, device=self.weight.device)
        self.register_parameter(fmt.scale_name, nn.Parameter(scale, requires_grad=False))

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.fmt.scale_name)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.scale_n, self.block_k, bias, self.fmt.round_scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * expand_scale(self.scale, tuple(self.weight.shape), self.scale_n,
                                                   self.block_k)).to(dtype)


def _aligned(start: int, size: int, block: int, what: str) -> None:
    if start % block:
        raise ValueError(f"{what}: a tensor-parallel slice starting at {start} cuts a {block}-wide scale block")


def _copy_scale(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    src = scale_to_float(src)
    if dst.dim() == 1 and src.numel() == dst.numel():
        src = src.reshape(-1)  # [N, 1], [N] and [] / [1] checkpoint spellings of one layout
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: checkpoint scale shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class FP8ColumnParallelLinear(_FP8Parallel, ColumnParallelLinear):
    def __init__(self, layer: ColumnParallelLinear, fmt: FP8Format):
        nn.Module.__init__(self)
        self.rows, self.weight, self.bias = layer.rows, layer.weight, layer.bias
        n, k = self.weight.shape
        if fmt.scheme == "block":
            _aligned(self.rows[0], n, fmt.block[0], "FP8 column-parallel rows")
        self._make_fp8_scaled(fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load_param(self, name: str, full: torch.Tensor) -> None:
        lo, hi = self.rows
        if name == self.fmt.scale_name:
            full = materialize(full)  # scales are small: read whole, cut here
            if self.fmt.scheme == "block":
                bn = self.fmt.block[0]
                full = full[lo // bn:-(-hi // bn)]
            elif self.fmt.scheme == "channel":
                full = full.reshape(-1)[lo:hi]
            _copy_scale(self.scale, full, name)
            return
        super().load_param(name, full)


class FP8MergedColumnParallelLinear(_FP8Parallel, MergedColumnParallelLinear):
    """Fused parts (q/k/v, gate/up), each with its own scales. Block scales keep their grid when
    every part but the last fills whole blocks (real models: 4096/1024/1024, 14336 = 112 x 128);
    otherwise each output row gets its part's scale row (scale_n 1)."""

    def __init__(self, layer: MergedColumnParallelLinear, fmt: FP8Format):
        nn.Module.__init__(self)
        for attr in ("part_rows", "local_sizes", "offsets", "weight", "bias"):
            setattr(self, attr, getattr(layer, attr))
        n, k = self.weight.shape
        if fmt.scheme == "block":
            bn, bk = fmt.block
            for lo, _ in self.part_rows:
                _aligned(lo, n, bn, "FP8 column-parallel rows")
            self.grid = all(size % bn == 0 for size in self.local_sizes[:-1])
            self._make_fp8(fmt, (-(-n // bn) if self.grid else n, -(-k // bk)), bn if self.grid else 1)
        else:
            self.grid = False
            self._make_fp8(fmt, (n,), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load_part(self, part: int, name: str, full: torch.Tensor) -> None:
        if name != self.fmt.scale_name:
            return super().load_part(part, name, full)
        lo, hi = self.part_rows[part]
        start, size = self.offsets[part], self.local_sizes[part]
        full = materialize(full)  # scales are small: read whole, cut here
        if self.fmt.scheme == "block":
            bn = self.fmt.block[0]
            rows = full[lo // bn:-(-hi // bn)]
            if self.grid:
                return _copy_scale(self.scale[start // bn:start // bn + rows.shape[0]], rows, name)
            rows = scale_to_float(rows).repeat_interleave(bn, 0)[lo % bn:lo % bn + size]
            return _copy_scale(self.scale[start:start + size], rows, name)
        per_row = scale_to_float(full).reshape(-1)
        per_row = per_row.expand(hi - lo) if per_row.numel() == 1 else per_row[lo:hi]
        _copy_scale(self.scale[start:start + size], per_row, name)

    def part(self, part: int, name: str) -> torch.Tensor:
        if name == self.fmt.scale_name:
            raise ValueError("FP8 scales of fused parts are not split back into checkpoint names")
        return super().part(part, name)


class FP8RowParallelLinear(_FP8Parallel, RowParallelLinear):
    def __init__(self, layer: RowParallelLinear, fmt: FP8Format):
        nn.Module.__init__(self)
        self.cols, self.tp_rank, self.weight, self.bias = layer.cols, layer.tp_rank, layer.weight, layer.bias
        self.tp_size, self.input_is_parallel = layer.tp_size, layer.input_is_parallel
        n, k = self.weight.shape
        if fmt.scheme == "block":
            _aligned(self.cols[0], k, fmt.block[1], "FP8 row-parallel columns")
        self._make_fp8_scaled(fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x[..., self.cols[0]:self.cols[1]]
        y = self._matmul(x, None)
        if self.bias is not None and self.tp_rank == 0:  # once in the sum over ranks
            y = y + self.bias
        return parallel.all_reduce(y) if self.tp_size > 1 else y

    def load_param(self, name: str, full: torch.Tensor) -> None:
        if name == self.fmt.scale_name:
            full = materialize(full)  # scales are small: read whole, cut here
            if self.fmt.scheme == "block":
                bk = self.fmt.block[1]
                lo, hi = self.cols
                full = full[:, lo // bk:-(-hi // bk)]
            _copy_scale(self.scale, full, name)
            return
        super().load_param(name, full)


class FP8ParallelLMHead(_FP8Parallel, ParallelLMHead):
    """A vocabulary-parallel lm_head over e4m3 codes, made only by quantizing a loaded head
    (quantize_model_linears with lm_head not skipped: an EAGLE-3 head's own lm_head under
    quantize_draft). Each rank quantizes its own padded slice of ceil(V / tp) rows on a grid that
    starts at its first row, so no TP size cuts a block; checkpoints never load into it."""

    def __init__(self, layer: ParallelLMHead, fmt: FP8Format):
        nn.Module.__init__(self)
        self.vocab_size, self.tp_size, self.rows, self.weight = layer.vocab_size, layer.tp_size, layer.rows, layer.weight
        self._make_fp8_scaled(fmt)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)

    def load_param(self, name: str, full: torch.Tensor) -> None:
        raise ValueError(f"lm_head.{name}: an FP8 lm_head is made by quantizing a loaded one, not loaded from a checkpoint")


def block_scaled_linears(*models: nn.Module | None) -> list[tuple[torch.Tensor, torch.Tensor, int, bool]]:
    """(weight, scale, scale_n, round_scale) of every FP8 linear with a block grid in the models
    (None skipped): what kernels.fp8.warm_library_gemms compiles library GEMMs for."""
    out = []
    for model in models:
        for mod in model.modules() if model is not None else ():
            if isinstance(mod, FP8Linear) and mod.weight_scale_inv.dim() == 2:
                out.append((mod.weight, mod.weight_scale_inv, mod.scale_n, mod.round_scale))
            elif isinstance(mod, _FP8Parallel) and mod.fmt.scheme == "block":
                out.append((mod.weight, mod.scale, mod.scale_n, mod.fmt.round_scale))
    return out


def warm_library_gemms(*models: nn.Module | None, max_m: int, dtype: torch.dtype) -> dict:
    """The boot-time library GEMM warm-up (kernels.fp8.warm_library_gemms) over the models' FP8
    block linears; {} where they have none or Triton is not installed."""
    linears = block_scaled_linears(*models)
    ops = kernels.fp8_ops()
    return ops.warm_library_gemms(linears, max_m, dtype) if linears and ops is not None else {}


_FP8_CLASSES = (
    (MergedColumnParallelLinear, FP8MergedColumnParallelLinear),
    (RowParallelLinear, FP8RowParallelLinear),
    (ColumnParallelLinear, FP8ColumnParallelLinear),
)


def _is_quantized(names: set[str], path: str, fmt: FP8Format, parent: nn.Module, child: str) -> bool:
    """Whether the checkpoint stores linear `path` in FP8: its scale tensor is there (for fused
    layers: every part's, or none)."""
    parts = [p for p, (fused, _) in getattr(parent, "fused_parts", {}).items() if fused == child]
    prefix = path.rpartition(".")[0]
    checkpoint_names = [f"{prefix}.{p}" if prefix else p for p in parts] or [path]
    present = [f"{name}.{fmt.scale_name}" in names for name in checkpoint_names]
    if any(present) and not all(present):
        raise ValueError(f"checkpoint: {path} fuses {checkpoint_names}, of which only some are FP8")
    return all(present)


def convert_fp8_linears(model: nn.Module, fmt: FP8Format, checkpoint_names: set[str]) -> list[str]:
    """Turn every parallel linear of `model` that the checkpoint stores in FP8 into its FP8
    variant (weights become e4m3 codes plus a scale parameter, both still to be loaded);
    -> the converted module paths. checkpoint_names: the checkpoint's tensor names, spelled as
    load_state sees them."""
    converted = []
    for path, module in list(model.named_modules()):
        if isinstance(module, _FP8Parallel):
            continue
        for plain, fp8_cls in _FP8_CLASSES:
            if isinstance(module, plain):
                parent_path, _, child = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                if _is_quantized(checkpoint_names, path, fmt, parent, child):
                    setattr(parent, child, fp8_cls(module, fmt))
                    converted.append(path)
                break
    return converted


def ignored_tensor(fmt: FP8Format | None) -> tuple[str, ...]:
    """Checkpoint suffixes load_state may skip for this format."""
    return () if fmt is None else fmt.ignored_suffixes


# The HF names of the linears the Llama-family models hold (what quantize_state_dict converts).
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_state_dict(state: dict[str, torch.Tensor], fmt: FP8Format,
                        linears: tuple[str, ...] = LLAMA_LINEARS) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint of a model's HF-named tensors as `fmt` stores it: every `<linear>.weight`
    becomes e4m3 codes plus `<linear>.<fmt.scale_name>`; everything else is kept. For tests and
    benchmarks (real FP8 checkpoints come quantized)."""
    out = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in linears:
            out[name] = tensor
            continue
        if fmt.scheme == "block":
            codes, scale = quantize_fp8_block(tensor, fmt.block)
        elif fmt.scheme == "channel":
            codes, scale = quantize_fp8_channel(tensor)
        else:
            scale = tensor.float().abs().amax().clamp(min=1e-12).reshape(()) / FP8_MAX
            codes = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[name] = codes
        out[f"{module}.{fmt.scale_name}"] = scale
    return out


def quantization_config(fmt: FP8Format) -> dict:
    """The config.json quantization_config that describes `fmt` (inverse of fp8_format)."""
    if fmt.scale_name == "weight_scale_inv":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fmt.scheme == "block":
            q["weight_block_size"] = list(fmt.block)
        if fmt.round_scale:
            q["scale_fmt"] = "ue8m0"
        return q
    weights = {"num_bits": 8, "type": "float", "strategy": fmt.scheme, "symmetric": True, "dynamic": False}
    if fmt.scheme == "block":
        weights["block_structure"] = list(fmt.block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token", "dynamic": True}}}}


# The engine's draft quantization at load (planner SpecSettings.draft_quantization "fp8"): the
# block layout of DeepSeek's and Qwen's FP8 checkpoints, which every FP8 kernel path serves.
DRAFT_FP8_FORMAT = FP8Format("block", "weight_scale_inv", (DRAFT_QUANTIZATION_BLOCK, DRAFT_QUANTIZATION_BLOCK))


def quantize_draft(draft: nn.Module, quantization: str) -> list[str]:
    """A loaded draft head's linears quantized in place as the plan says (DRAFT_QUANTIZATIONS):
    "fp8" converts every projection of its layers, its input projection and, on an EAGLE-3 head,
    its own vocabulary lm_head to DRAFT_FP8_FORMAT; embeddings and norms stay (an EAGLE head's
    embedding and lm_head are the target's). -> the converted paths."""
    if quantization != "fp8":
        raise ValueError(f"draft quantization {quantization!r}: the engine quantizes drafts to fp8 only")
    return quantize_model_linears(draft, DRAFT_FP8_FORMAT, skip=())


@torch.no_grad()
def quantize_model_linears(model: nn.Module, fmt: FP8Format, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Quantize a built model's parallel linears in place, as an FP8 checkpoint of its current
    weights would be loaded (a draft quantized at load, quantize_draft; benchmarks of FP8 against
    bf16 on the same weights): each becomes
    its FP8 variant holding e4m3 codes and scales; the high-precision weights are dropped. Fused
    parts are quantized part by part, as a checkpoint stores them. -> the converted paths."""
    converted = []
    for path, module in list(model.named_modules()):
        if isinstance(module, _FP8Parallel) or any(path == s or path.endswith("." + s) for s in skip):
            continue
        for plain, fp8_cls in _FP8_CLASSES + ((ParallelLMHead, FP8ParallelLMHead),):
            if not isinstance(module, plain):
                continue
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            w = module.weight.detach()
            parts = (list(zip(module.offsets, module.local_sizes)) if isinstance(module, MergedColumnParallelLinear)
                     else [(0, w.shape[0])])
            quantized = [quantize_state_dict({"x.weight": w[start:start + size]}, fmt, ("x",)) for start, size in parts]
            new = fp8_cls(module, fmt)
            for i, q in enumerate(quantized):
                start, size = parts[i]
                new.weight[start:start + size] = q["x.weight"]
                if isinstance(new, FP8MergedColumnParallelLinear):
                    # a part's own rows, as if it were the whole tensor of a checkpoint
                    lo_saved = new.part_rows[i]
                    new.part_rows[i] = (0, size)
                    new.load_part(i, fmt.scale_name, q[f"x.{fmt.scale_name}"])
                    new.part_rows[i] = lo_saved
                else:
                    _copy_scale(new.scale, q[f"x.{fmt.scale_name}"], path)
            setattr(parent, child, new)
            converted.append(path)
            break
    return converted
