"""Every Triton kernel of the engine passes the compiler's front end for Hopper (sm_90) on CPU.

The interpreter tests check numerics but not typing: Triton's compiler refuses programs the
interpreter runs (for example one variable holding pointers of two dtypes in the branches of an
`if`). Lowering each kernel to Triton IR for a CUDA target needs no GPU, so CI catches those.
Signatures cover the dtype mixes the engine launches: bf16 and fp32 activations, and a KV pool in
another dtype than the activations (autocast inference over a float32 pool).
"""

import pytest

triton = pytest.importorskip("triton")

from specdeploy.engine.kernels import attention as attention_triton  # noqa: E402
from specdeploy.engine.kernels import elementwise as elementwise_triton  # noqa: E402
from specdeploy.engine.kernels import fp4 as fp4_triton  # noqa: E402
from specdeploy.engine.kernels import fp8 as fp8_triton  # noqa: E402
from specdeploy.engine.kernels import hc as hc_triton  # noqa: E402

INDEX_PTRS = {"slots_ptr", "prefix_slots_ptr", "prefix_lens_ptr", "new_slots_ptr"}
FLOAT_SCALARS = {"eps", "sm_scale", "norm_eps", "hc_eps", "k_scale", "v_scale"}


def lower_to_ttir(kernel, pointer_dtypes: dict[str, str], constexprs: dict) -> None:
    from triton.compiler import ASTSource

    if "USE_GDC" in kernel.arg_names:
        constexprs = {"USE_GDC": True, **constexprs}  # the variant launched on Hopper (launch.py)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*i64" if name in INDEX_PTRS else
                               "*i1" if name == "new_mask_ptr" else pointer_dtypes.get(name, pointer_dtypes["*"]))
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    make_ttir(ASTSource(fn=kernel, signature=signature, constexprs=constexprs))


def make_ttir(source) -> None:
    """Lower one kernel source to Triton IR for sm_90 (the front end; no GPU, no PTX)."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({})
    libtriton = triton._C.libtriton
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options),
                   backend.get_module_map(), context)


ACTIVATIONS = ["*bf16", "*fp32"]


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("pool", ACTIVATIONS)
def test_rope_store_compiles(act, pool):
    lower_to_ttir(elementwise_triton._rope_store_kernel,
                  {"*": act, "k_cache_ptr": pool, "v_cache_ptr": pool}, {"HEAD_DIM": 128, "FP8": False})


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_rope_store_into_an_fp8_pool_compiles(act):
    lower_to_ttir(elementwise_triton._rope_store_kernel,
                  {"*": act, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}, {"HEAD_DIM": 128, "FP8": True})


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("weight", ACTIVATIONS)
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_compiles(act, weight, add):
    lower_to_ttir(elementwise_triton._rms_norm_kernel, {"*": act, "w_ptr": weight},
                  {"ADD": add, "BLOCK": 4096})


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_silu_mul_compiles(act):
    lower_to_ttir(elementwise_triton._silu_mul_kernel, {"*": act}, {"BLOCK": 1024})


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("splits", [1, 8])
def test_split_attention_compiles(act, splits):
    # attend() casts queries to the pool's dtype, so the kernel sees one dtype for q, k and v.
    lower_to_ttir(attention_triton._split_attention_kernel,
                  {"*": act, "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                   "part_l_ptr": "*fp32"},
                  {"HEAD_DIM": 128, "BLOCK_M": 16, "BLOCK_K": 64, "NUM_SPLITS": splits,
                   "PRECISION": "ieee" if act == "*fp32" else "tf32"})


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_combine_compiles(act):
    lower_to_ttir(attention_triton._combine_kernel, {"*": act, "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                                                     "part_l_ptr": "*fp32"},
                  {"HEAD_DIM": 128, "NUM_SPLITS": 8})


@pytest.mark.parametrize("logits", ACTIVATIONS)
def test_argmax_compiles(logits):
    lower_to_ttir(elementwise_triton._argmax_chunks_kernel, {"*": logits, "val_ptr": "*fp32", "idx_ptr": "*i32"},
                  {"BLOCK": elementwise_triton.ARGMAX_CHUNK})
    lower_to_ttir(elementwise_triton._argmax_combine_kernel, {"*": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64"},
                  {"BLOCK_C": 32})


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("head", [False, True])
def test_hyper_connection_compiles(act, head):
    # Streams, the collapsed input and the sublayer output in the activation dtype; the mixes,
    # gates and comb in float32.
    lower_to_ttir(hc_triton._hc_pre_kernel, {"*": "*fp32", "streams_ptr": act, "x_ptr": act},
                  {"HEAD": head, "HC_P": 4, "BLOCK": hc_triton.PRE_BLOCK})
    lower_to_ttir(hc_triton._hc_expand_kernel, {"*": act, "post_ptr": "*fp32", "comb_ptr": "*fp32"},
                  {"HC_P": 4, "BLOCK": hc_triton.EXPAND_BLOCK})


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("tile", [(1, 4), (16, 2)])
def test_fp8_act_quant_compiles(act, round_scale, tile):
    lower_to_ttir(fp8_triton._act_quant_kernel, {"*": act, "y_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                  {"GROUP": fp8_triton.GROUP_K, "GROUPS": tile[1], "ROWS": tile[0], "ROUND_SCALE": round_scale})


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("scale_n", [128, 1])
@pytest.mark.parametrize("block_m", [16, 64])
def test_fp8_weight_only_linear_compiles(act, scale_n, block_m):
    lower_to_ttir(fp8_triton._w8a16_kernel, {"*": act, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"},
                  {"SCALE_N": scale_n, "HAS_BIAS": True, "PRECISION": "ieee" if act == "*fp32" else "tf32",
                   "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": fp8_triton.GROUP_K})


@pytest.mark.parametrize("out", ACTIVATIONS)
@pytest.mark.parametrize("scale_n", [128, 1])
def test_fp8_w8a8_linear_compiles(out, scale_n):
    lower_to_ttir(fp8_triton._w8a8_kernel, {"*": out, "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "as_ptr": "*fp32",
                                            "ws_ptr": "*fp32"},
                  {"SCALE_N": scale_n, "HAS_BIAS": False, "BLOCK_M": 128, "BLOCK_N": 128,
                   "BLOCK_K": fp8_triton.GROUP_K, "GROUP_M": 8})


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_split_attention_over_an_fp8_pool_compiles(act):
    # An e4m3 pool's codes are widened to the queries' dtype as they are loaded.
    lower_to_ttir(attention_triton._split_attention_kernel,
                  {"*": act, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "part_acc_ptr": "*fp32",
                   "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"},
                  {"HEAD_DIM": 128, "BLOCK_M": 16, "BLOCK_K": 64, "NUM_SPLITS": 4,
                   "PRECISION": "ieee" if act == "*fp32" else "tf32"})


def _gemv_source(weight: str, act: str, constexprs: dict, divisible: bool = True):
    """The small-M linear kernel's source for one launch; ints (but M) divisible by 16, as Triton
    specializes them at the engine's shapes (K, N, strides, the split's k range)."""
    from triton.compiler import ASTSource

    from specdeploy.engine.kernels import gemv as gemv_triton
    kernel = gemv_triton._gemv_kernel
    constexprs = {"USE_GDC": True, "SUB_K": gemv_triton.GROUP_K, **constexprs}
    pointers = {"w_ptr": weight, "s_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    signature = {name: "constexpr" if name in constexprs else
                 pointers.get(name, act) if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if divisible and signature[name] != "constexpr" and name != "M"}
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _gemv_constexprs(mode, dot, split, block_m, block_n, block_k, stages=3, even=True, act="*bf16",
                     quant_x=False, round_scale=False, x_f16=False, one_row=False, x_rows=0):
    return {"SCALE_MODE": mode, "SCALE_N": 128 if mode == 1 else 1, "HAS_BIAS": split != 2, "USE_DOT": dot,
            "PRECISION": "ieee" if act == "*fp32" else "tf32", "EVEN_K": even, "SPLIT_K": split,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages,
            "QUANT_X": quant_x, "ROUND_SCALE": round_scale, "X_F16": x_f16, "ONE_ROW": one_row,
            "X_ROWS": x_rows, "PF_COLS": 0, "PF_STEP": 32, "SWAP": False}


@pytest.mark.parametrize("weight,act,mode", [("*fp8e4nv", "*bf16", 1), ("*fp8e4nv", "*bf16", 2), ("*fp8e4nv", "*fp32", 3),
                                             ("*bf16", "*bf16", 0), ("*fp32", "*fp32", 0)])
@pytest.mark.parametrize("dot,block_m,block_n", [(False, 1, 8), (False, 4, 16), (True, 16, 32)])
@pytest.mark.parametrize("split,even", [(1, True), (4, False)])
def test_gemv_lowers(weight, act, mode, dot, block_m, block_n, split, even):
    make_ttir(_gemv_source(weight, act, _gemv_constexprs(mode, dot, split, block_m, block_n, 256, even=even, act=act)))


@pytest.mark.parametrize("weight,mode,dot,block_m,block_n,block_k", [
    ("*fp8e4nv", 1, False, 1, 8, 512),     # decode over FP8 block weights
    ("*fp8e4nv", 1, True, 16, 64, 256),    # a 16-row verify batch
    ("*bf16", 0, False, 4, 16, 256),       # plain weights, 4 rows
])
def test_gemv_compiles_to_a_pipelined_cubin(weight, mode, dot, block_m, block_n, block_k):
    """The whole compiler (PTX and cubin, no GPU needed): the weight tiles stream through
    cp.async into shared memory, (num_stages - 1) deep. Without tl.range's num_stages the fma
    loop (no tl.dot) would not be pipelined at all."""
    from triton.backends.compiler import GPUTarget
    stages = 3
    compiled = triton.compile(_gemv_source(weight, "*bf16", _gemv_constexprs(mode, dot, 2, block_m, block_n, block_k,
                                                                             stages)),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    assert "cp.async" in compiled.asm["ptx"]
    tile = block_n * block_k * (1 if weight == "*fp8e4nv" else 2)
    assert compiled.metadata.shared >= (stages - 1) * tile


@pytest.mark.parametrize("mode,round_scale", [(1, False), (2, False), (3, True)])
def test_gemv_wg8_compiles_to_native_e4m3_wgmma(mode, round_scale):
    """The wg8 variant (activations quantized to e4m3 in-kernel, 64 padded rows) multiplies e4m3
    by e4m3 on Hopper's wgmma: the weight codes are never widened to f16 (dot8, 16 rows, goes
    through mma.sync, which widens both operands on sm_90: also checked, so a Triton that starts
    emitting native e4m3 there shows up here)."""
    from triton.backends.compiler import GPUTarget

    def ptx(block_m):
        return triton.compile(_gemv_source("*fp8e4nv", "*bf16", _gemv_constexprs(
            mode, True, 2, block_m, 64, 128, quant_x=True, round_scale=round_scale)),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]

    wg8 = ptx(64)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in wg8
    assert "cvt.rn.f16x2.e4m3x2" not in wg8
    assert "cvt.rn.satfinite.e4m3x2.f32" in wg8  # x rounded to e4m3 in the kernel
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx(16)


@pytest.mark.parametrize("mode,round_scale", [(1, False), (2, True), (3, False)])
def test_gemv_sw8_is_native_e4m3_wgmma_with_x_as_its_16_columns(mode, round_scale):
    """sw8 (the product swapped): the weight tile is the wgmma's 64-row e4m3 operand, x the
    16-column one, quantized in the kernel; no code is widened."""
    from triton.backends.compiler import GPUTarget

    import torch
    from specdeploy.engine.kernels import gemv as gemv_triton
    _, const = gemv_triton.launch_constexprs("fp8", torch.bfloat16, 4, 6144, 4096, mode, 128 if mode == 1 else 1,
                                             False, True, "sw8", 64, 128, 4, 3, round_scale)
    const.pop("K_SPLIT")
    assert const["SWAP"] and const["BLOCK_M"] == 16 and not const["QUANT_X"]
    ptx = triton.compile(_gemv_source("*fp8e4nv", "*bf16", const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx
    assert "cvt.rn.f16x2.e4m3x2" not in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_gemv_dot16_widens_codes_once(mode):
    """dot16 (16 rows, mma.sync) and wg16 (64 rows, wgmma): the weight-only product on the f16
    tensor cores. Each pair of codes takes one cvt.rn.f16x2.e4m3x2 and nothing else, where the
    bf16 dot widens every code again (cvt.bf16.f16)."""
    from triton.backends.compiler import GPUTarget

    def ptx(block_m, x_f16, one_row=False, x_rows=0, block_k=128):
        return triton.compile(_gemv_source("*fp8e4nv", "*bf16", _gemv_constexprs(
            mode, True, 2, block_m, 64, block_k, x_f16=x_f16, one_row=one_row, x_rows=x_rows)),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]

    dot16, bf16 = ptx(16, True), ptx(16, False)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in dot16
    assert "cvt.rn.f16x2.e4m3x2" in dot16 and "cvt.bf16.f16" not in dot16
    assert "cvt.bf16.f16" in bf16  # what dot16 saves
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in ptx(64, True)
    # one row (batch 1): x is widened one element a thread, not [16, 128] per group
    one = ptx(16, True, one_row=True)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in one
    assert one.count("cvt.f32.bf16") < dot16.count("cvt.f32.bf16") // 4
    four = ptx(16, True, x_rows=4)  # 4 rows (a chain's verify step): a fraction of the padded widening
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in four
    assert four.count("cvt.f32.bf16") < dot16.count("cvt.f32.bf16") // 2
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in ptx(64, True, x_rows=8)
    # two 128-wide groups a k step (the inner loop unrolled twice) compile as well
    for block_m, one_row, x_rows in ((16, True, 0), (16, False, 4), (64, False, 8), (16, False, 0)):
        assert "mma" in ptx(block_m, True, one_row, x_rows, block_k=256)


@pytest.mark.parametrize("out", ACTIVATIONS)
def test_fp4_dequant_compiles(out):
    lower_to_ttir(fp4_triton._dequant_fp4_kernel, {"*": "*u8", "out_ptr": out},
                  {"GROUP": fp4_triton.GROUP, "BLOCK_ROWS": fp4_triton.BLOCK_ROWS,
                   "BLOCK_BYTES": fp4_triton.BLOCK_BYTES})


def test_every_launch_the_table_and_heuristic_make_compiles():
    """Each distinct launch of the small-M linear that the engine makes at the Llama-3.1-8B
    shapes (and its EAGLE-3 fc, and a TP 2 half) for 1..16 rows, FP8 block and row scales and
    plain bf16 weights, through the whole compiler for sm_90 (gemv.launch_constexprs is what
    gemv.launch launches): the interpreter runs programs the compiler refuses (a constexpr
    assigned inside an unrolled loop once failed only on the GPU)."""
    from triton.backends.compiler import GPUTarget

    import torch
    from specdeploy.engine.kernels import gemv as gemv_triton
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 12288), (3072, 4096)]
    seen = {}
    for kind in ("fp8", "plain"):
        for n, k in shapes:
            for m in (1, 2, 3, 4, 5, 8, 9, 16):  # every M bucket's ends and every padded x height
                cfg = gemv_triton.config_for(kind, n, k, m, torch.device("cpu"))
                if cfg[0] == "cublas":
                    continue
                variant, block_n, block_k, split, warps, stages = cfg
                for mode, scale_n in ([(1, 128), (3, 1)] if kind == "fp8" else [(0, 1)]):
                    if mode == 1 and 128 % block_n:
                        mode, scale_n = 3, 1
                    _, const = gemv_triton.launch_constexprs(kind, torch.bfloat16, m, n, k, mode, scale_n, False, True,
                                                             variant, block_n, block_k, split, stages)
                    const.pop("K_SPLIT")
                    seen.setdefault((kind, tuple(sorted(const.items())), warps), (const, warps))
    assert len(seen) > 10
    for (kind, _, _), (const, warps) in seen.items():
        weight = "*fp8e4nv" if kind == "fp8" else "*bf16"
        triton.compile(_gemv_source(weight, "*bf16", const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": const["STAGES"]})


@pytest.mark.parametrize("gathered,act,weighted", [(True, True, False), (True, False, True), (False, True, False),
                                                   (False, False, True)])
@pytest.mark.parametrize("config", ["m16n32k128", "m16n64k128g", "m16n32k128gp", "m64n128k64"])
def test_fp4_moe_compiles(gathered, act, weighted, config):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdeploy.engine.kernels import fp4_moe

    cfg = fp4_moe.CONFIGS[config]
    constexprs = {"GATHERED": gathered, "TOPK": 6 if gathered else 1, "ACT": act, "LIMIT": act,
                  "WEIGHTED": weighted, "GROUP": fp4_moe.GROUP, "GROUP_DOT": cfg.group_dot, "PTX": cfg.ptx, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk}
    pointers = {"x_ptr": "*bf16", "out_ptr": "*bf16", "weight_ptr": "*bf16", "codes_ptr": "*u8", "bits_ptr": "*u8"}
    kernel = fp4_moe._fp4_moe_kernel
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*i64") if name.endswith("_ptr")
                 else "fp32" if name == "limit" else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.warps, "num_stages": cfg.stages})
    assert "cvt.rn.f16x2.e4m3x2" in compiled.asm["ptx"] or "e4m3" in compiled.asm["ptx"]  # the hardware conversion


@pytest.mark.parametrize("weight,act,elem", [("*fp8e4nv", "*bf16", 1), ("*bf16", "*bf16", 2)])
def test_gemv_prefetches_its_weights_before_the_pdl_wait(weight, act, elem):
    """With PDL the small-M linear pulls the first bytes of its weight rows into L2 before
    griddepcontrol.wait (the weights are no kernel's output), 32-byte sectors, and nothing else
    it reads or writes comes before the wait; without a prefetch size there is none."""
    from triton.backends.compiler import GPUTarget

    import torch
    from specdeploy.engine.kernels import gemv as gemv_triton

    def ptx(prefetch):
        _, const = gemv_triton.launch_constexprs("fp8" if elem == 1 else "plain", torch.bfloat16, 1, 6144, 4096,
                                                 1 if elem == 1 else 0, 128 if elem == 1 else 1, False, True,
                                                 "fma", 16, 512, 1, 3, prefetch=prefetch, weight_bytes=elem)
        const.pop("K_SPLIT")
        return const, triton.compile(_gemv_source(weight, act, const), target=GPUTarget("cuda", 90, 32),
                                     options={"num_warps": 2, "num_stages": 3}).asm["ptx"]

    const, on = ptx(2048)
    assert const["PF_COLS"] == 2048 // elem and const["PF_STEP"] == 32 // elem
    wait = on.index("griddepcontrol.wait")
    before = on[:wait]
    # [BLOCK_N 16 rows, 2048 / 32 sectors] over 64 threads
    assert before.count("prefetch.global.L2") == 16 * (2048 // 32) // 64
    assert "ld.global" not in before and "st.global" not in before and "cp.async" not in before
    _, off = ptx(0)
    assert "prefetch.global.L2" not in off


def test_gemv_prefetch_size_fits_the_programs_k_range():
    """The prefetch is a power of two of sectors, at most the bytes asked for and within the
    program's split of K."""
    import torch
    from specdeploy.engine.kernels import gemv as gemv_triton

    def cols(prefetch, k=4096, split=1, elem=1, block_k=512):
        return gemv_triton.launch_constexprs("fp8" if elem == 1 else "plain", torch.bfloat16, 1, 4096, k, 1, 128,
                                             False, True, "fma", 16, block_k, split, 3, prefetch=prefetch,
                                             weight_bytes=elem)[1]["PF_COLS"]

    assert cols(0) == 0 and cols(31) == 0   # less than one sector: none
    assert cols(2048) == 2048 and cols(3000) == 2048 and cols(2048, elem=2) == 1024
    assert cols(8192) == 4096               # the whole row, no further
    assert cols(8192, k=14336, split=8, block_k=256) == 1024   # a 1792-wide split: 56 sectors -> 32
