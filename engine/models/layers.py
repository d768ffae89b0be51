"""Building blocks shared by the target and draft models.

Linear layers and embeddings are tensor-parallel: each rank holds a slice of the full weight
and `load_param` cuts that slice out of the checkpoint tensor (a torch tensor, or a lazy
`TensorSource` of engine/models/checkpoint.py that reads only the slice from disk, so no rank
ever holds a whole matrix).

    ColumnParallelLinear      W [out / tp, in]        output sharded, no collective
    MergedColumnParallelLinear (q/k/v, gate/up)       each part sharded on its own
    RowParallelLinear         W [out, in / tp]        all-reduce of the output; with
                                                      input_is_parallel=False the rank first
                                                      takes its columns of a replicated input
    VocabParallelEmbedding    rows [ceil(V / tp), H]  masked lookup, all-reduce
    ParallelLMHead            rows [ceil(V / tp), H]  all-gather of the logits, cut back to V
Vocabularies that tp does not divide are padded to tp * ceil(V / tp) rows (zero rows past V).
KV heads fewer than tp are replicated: rank r holds kv head r // (tp / num_kv_heads), the one
its query heads read (`kv_head_range`, the same count the planner's kv_heads_per_gpu makes).
Collectives come from engine/parallel.py and are CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.engine import kernels
from specdeploy.engine.models.checkpoint import TensorSource, count_loaded
from specdeploy.engine.planner.shapes import kv_heads_per_gpu
from specdeploy.engine import parallel


def materialize(src) -> torch.Tensor:
    """The whole tensor of a checkpoint source (a TensorSource reads it now; a tensor is itself)."""
    return src.read() if isinstance(src, TensorSource) else src


def _shard_range(full: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if full % tp_size:
        raise ValueError(f"{what}={full} is not divisible by tp_size={tp_size}")
    part = full // tp_size
    return tp_rank * part, (tp_rank + 1) * part


def _padded_range(full: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows [lo, lo + ceil(full / tp)) of a dimension padded to a multiple of tp."""
    part = -(-full // tp_size)
    return tp_rank * part, (tp_rank + 1) * part


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The KV heads rank r holds: its share when tp divides them, else (fewer heads than ranks)
    the one head its query heads use, replicated on tp / num_kv_heads ranks."""
    local = kv_heads_per_gpu(num_kv_heads, tp_size)
    if num_kv_heads % tp_size == 0:
        return tp_rank * local, (tp_rank + 1) * local
    if tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} neither divides nor is divisible by tp_size={tp_size}")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def _rows(src, lo: int, hi: int, full: int) -> torch.Tensor:
    """Rows lo:hi of src [full, ...], zero rows past `full` (padding)."""
    hi_real = min(hi, full)
    part = src.narrow(0, lo, max(hi_real - lo, 0))
    if hi_real == hi:
        return part
    pad = torch.zeros((hi - lo - part.shape[0], *part.shape[1:]), dtype=part.dtype)
    return torch.cat([part, pad])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CUDA for calls of at most GEMV_MAX_M rows (decode, small verify
    batches) whose shape the small-M kernel's launch table gives to the kernel rather than to
    cuBLAS (engine/kernels/gemv.py). CPU always runs F.linear."""
    fast = fused_kernels(x, weight, ops=kernels.gemv_ops)
    if fast is not None:
        y = fast.plain_linear(x, weight, bias)
        return y if y is not None else fast.library_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W [out_features / tp, in_features] on each rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.rows = _shard_range(out_features, tp_rank, tp_size, "out_features")
        part = self.rows[1] - self.rows[0]
        self.weight = nn.Parameter(torch.empty(part, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(part), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_param(self, name: str, full) -> None:
        _copy(getattr(self, name), full.narrow(0, self.rows[0], self.rows[1] - self.rows[0]), name)


class MergedColumnParallelLinear(nn.Module):
    """Column-parallel layers that read the same input, computed as one matmul
    (q/k/v, gate/up): W [sum_i out_i / tp, in_features]. Each part is sharded on its own, so rank
    r holds [part_0 rows of rank r; part_1 rows of rank r; ...], the rows the separate layers
    would hold, and the output splits into the parts' local widths. Checkpoints keep one tensor
    per part; `load_part` writes one into its slice. `part_rows` overrides a part's (lo, hi)
    rows (replicated KV heads)."""

    def __init__(self, in_features: int, out_features: tuple[int, ...], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1,
                 part_rows: tuple[tuple[int, int] | None, ...] | None = None):
        super().__init__()
        part_rows = part_rows or (None,) * len(out_features)
        self.part_rows = [rows or _shard_range(n, tp_rank, tp_size, "out_features")
                          for n, rows in zip(out_features, part_rows)]
        self.local_sizes = [hi - lo for lo, hi in self.part_rows]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum_i out_i / tp], the parts side by side (`split` cuts them)."""
        return linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., sum_i out_i / tp] -> one view [..., out_i / tp] per part."""
        return y.split(self.local_sizes, dim=-1)

    def load_part(self, part: int, name: str, full) -> None:
        lo, hi = self.part_rows[part]
        start = self.offsets[part]
        _copy(getattr(self, name)[start:start + self.local_sizes[part]], full.narrow(0, lo, hi - lo), name)

    def part(self, part: int, name: str) -> torch.Tensor:
        """This rank's rows of one part (what the separate layer's parameter would be)."""
        start = self.offsets[part]
        return getattr(self, name)[start:start + self.local_sizes[part]]


def register_fused_parts(module: nn.Module, parts: dict[str, tuple[str, int]]) -> None:
    """Declare that checkpoint child names (e.g. `q_proj`) live as part i of a fused child
    (`qkv_proj`, a MergedColumnParallelLinear): `load_state` routes `<prefix>.q_proj.weight`
    there, and `state_dict()` writes the separate names back, as HF checkpoints hold them."""
    module.fused_parts = parts
    module._register_state_dict_hook(_split_fused_state)


def _split_fused_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    for part_name, (fused_name, part) in module.fused_parts.items():
        fused = getattr(module, fused_name)
        for pname in ("weight", "bias"):
            key = f"{prefix}{fused_name}.{pname}"
            if key in state:
                state[f"{prefix}{part_name}.{pname}"] = fused.part(part, pname).detach()
    for fused_name in {f for f, _ in module.fused_parts.values()}:
        for pname in ("weight", "bias"):
            state.pop(f"{prefix}{fused_name}.{pname}", None)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features / tp], summed over the ranks (all-reduce).
    input_is_parallel: x arrives sharded [..., in / tp] (after a column-parallel layer); False:
    x is replicated [..., in] and each rank multiplies its own columns of it (a draft head's fc
    over [embedding; hidden])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, input_is_parallel: bool = True):
        super().__init__()
        self.cols = _shard_range(in_features, tp_rank, tp_size, "in_features")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.cols[1] - self.cols[0]),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x[..., self.cols[0]:self.cols[1]]
        # The bias joins on rank 0 only, so that the sum over ranks adds it once.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return parallel.all_reduce(y) if self.tp_size > 1 else y

    def load_param(self, name: str, full) -> None:
        if name == "weight":
            _copy(self.weight, full.narrow(1, self.cols[0], self.cols[1] - self.cols[0]), name)
        else:
            _copy(getattr(self, name), materialize(full), name)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [ceil(vocab / tp), H] are split across ranks; a lookup is the sum
    over ranks of each rank's rows (zero where the id is another rank's)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = _padded_range(vocab_size, tp_rank, tp_size)
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(self.rows[1] - self.rows[0], hidden_size),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def load_param(self, name: str, full) -> None:
        _copy(self.weight, _rows(full, *self.rows, self.vocab_size), "embedding")


class ParallelLMHead(nn.Module):
    """lm_head split over vocabulary rows [ceil(V / tp), H]; each rank computes its logits slice
    and the all-gather hands every rank the whole [..., V]."""

    def __init__(self, hidden_size: int, vocab_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.rows = _padded_range(vocab_size, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(self.rows[1] - self.rows[0], hidden_size),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_logits(x)
        if self.tp_size == 1:
            return y
        return parallel.all_gather(y)[..., :self.vocab_size]

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits [..., ceil(V / tp)]."""
        return linear(x, self.weight)

    def load_param(self, name: str, full) -> None:
        _copy(self.weight, _rows(full, *self.rows, self.vocab_size), "lm_head")


def fused_kernels(x: torch.Tensor, *params: torch.Tensor, ops=kernels.elementwise_ops):
    """A Triton kernel module (`ops`: one of engine.kernels' loaders, the elementwise kernels by
    default) where it applies: CUDA tensors, Triton installed, and no gradient to track (the
    kernels have no backward; training runs the torch code). None otherwise: the caller runs its
    torch code."""
    if not x.is_cuda:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    return ops()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (the first maximum), through a Triton kernel that splits each row
    across the GPU on CUDA: greedy picks over a vocabulary are otherwise one slow block per row."""
    fast = fused_kernels(x)
    return fast.argmax(x) if fast is not None else x.argmax(-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_kernels(x, self.weight)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it, one kernel on CUDA."""
        fused = fused_kernels(x, delta, self.weight)
        if fused is not None and delta.dtype == x.dtype:
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)

    def load_param(self, name: str, full) -> None:
        _copy(self.weight, materialize(full), "norm weight")


class GatedMLP(nn.Module):
    """SwiGLU MLP; gate and up fused into one column-parallel matmul (checkpoint names
    gate_proj/up_proj), down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, (intermediate_size, intermediate_size), bias, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_rank, tp_size)
        register_fused_parts(self, {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))   # [..., I / tp] each
        fused = fused_kernels(x, self.gate_up_proj.weight)
        return self.down_proj(fused.silu_mul(gate, up) if fused is not None else F.silu(gate) * up)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2]; supports the llama3 frequency-dependent scaling and
    linear scaling. Other rope types are refused rather than silently ignored."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_ff = float(scaling["low_freq_factor"])
        high_ff = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
        # and the band in between is interpolated smoothly.
        scaled = torch.where(wavelen > old_ctx / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high_ff) & (wavelen <= old_ctx / low_ff)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos/sin [..., D] broadcast over heads (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


def load_state(module: nn.Module, tensors, ignore: tuple[str, ...] = ()) -> None:
    """Load (name, full tensor) pairs into `module`. A layer with `load_param` cuts its
    tensor-parallel shard itself; other parameters/buffers are copied whole. Every parameter must
    be provided and every checkpoint name must be known (except names matching `ignore`
    prefixes/suffixes); either mismatch is an error naming the tensors."""
    params = dict(module.named_parameters(remove_duplicate=False))
    params.update(dict(module.named_buffers()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    fused_loaded: dict[str, set[str]] = {}   # fused parameter -> checkpoint names written into it
    for name, tensor in tensors:
        fused = _fused_target(module, name)
        if fused is not None and fused[0] in params:
            fused_name, layer, part = fused
            pname = fused_name.rpartition(".")[2]
            layer.load_part(part, pname, tensor)
            count_loaded(_part_bytes(layer, part, pname))
            fused_loaded.setdefault(fused_name, set()).add(name)
            continue
        if name not in params:
            if not any(name.startswith(p) or name.endswith(p) for p in ignore):
                unexpected.append(name)
            continue
        owner_path, _, pname = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        if hasattr(owner, "load_param"):
            owner.load_param(pname, tensor)
        else:
            _copy(params[name], materialize(tensor), name)
        count_loaded(params[name].nbytes)  # this rank's share of it
        loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has tensors the model does not know: {sorted(unexpected)[:8]}")
    missing = []
    fused_parts = _fused_part_names(module)
    for fused_name, expected in fused_parts.items():
        if fused_name in params:
            absent = expected - fused_loaded.get(fused_name, set())
            missing += sorted(absent)
            if not absent:
                loaded.add(fused_name)
    shared = {id(p) for n, p in module.named_parameters() if n in loaded}
    missing += [n for n, p in module.named_parameters(remove_duplicate=False)
                if n not in loaded and id(p) not in shared and n not in fused_parts]
    persistent = module.state_dict().keys()
    missing += [n for n, _ in module.named_buffers() if n not in loaded and n in persistent]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")


def _part_bytes(layer: nn.Module, part: int, pname: str) -> int:
    """This rank's bytes of one part of a fused parameter (its share of the rows: an FP8 scale's
    rows are blocks, so its share is the same fraction)."""
    param = getattr(layer, pname)
    sizes = getattr(layer, "local_sizes", None)
    return param.nbytes * sizes[part] // sum(sizes) if sizes else param.nbytes


def _fused_target(module: nn.Module, name: str):
    """`a.b.q_proj.weight` -> (`a.b.qkv_proj.weight`, the fused layer, part index) when module
    `a.b` declares q_proj a fused part; else None."""
    path, _, pname = name.rpartition(".")
    parent_path, _, child = path.rpartition(".")
    try:
        parent = module.get_submodule(parent_path)
    except AttributeError:
        return None
    fused = getattr(parent, "fused_parts", {}).get(child)
    if fused is None:
        return None
    fused_child, part = fused
    fused_name = f"{parent_path}.{fused_child}.{pname}" if parent_path else f"{fused_child}.{pname}"
    return fused_name, getattr(parent, fused_child), part


def _fused_part_names(module: nn.Module) -> dict[str, set[str]]:
    """Fused parameter name -> the checkpoint names that fill it, over the whole module tree."""
    out: dict[str, set[str]] = {}
    for path, sub in module.named_modules():
        for part_name, (fused_child, _) in getattr(sub, "fused_parts", {}).items():
            for pname, _ in getattr(sub, fused_child).named_parameters(recurse=False):
                pre = f"{path}." if path else ""
                out.setdefault(f"{pre}{fused_child}.{pname}", set()).add(f"{pre}{part_name}.{pname}")
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match "
                         f"the model's {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)  # casts to dst's dtype element by element: no second full-size copy
