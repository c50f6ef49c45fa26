"""Compiles the paged attention kernels, the two-rank peer sum and the norms that quantize their rows for FP8 for
the H100 (sm90) on a machine without a GPU, every variant of constexprs the engine launches, and every kernel of a
decode step launched early (gpu_ops/launch.py: grid dependency control, a path the interpreter never takes),
through Triton's whole pipeline (its bundled ptxas included): the interpreter
that runs the kernels in CI does not apply the compiler's checks (a helper's return types, say), so a kernel
can pass every CPU test and fail to compile on the GPU. Run by test_compile_sm90.py in a process of its own
(the interpreter is chosen when a kernel module is imported). Prints one line per variant; exit status 1 if one
fails.
Then the LoRA kernels whose adapter pages the compiler must read 16 bytes at a time (`page_pointers(..., WIDE=True)`),
specialised as the JIT specialises the engine's calls on the 7B shape: each line says whether the compiled kernel
holds any 2-byte global load. Under Triton 3.6 (the GPU machine's) they fail without WIDE's hint; Triton 3.9 (CI's)
sees the alignment on its own, so there this check catches only what else would narrow the loads (a mask whose
width the compiler cannot bound, as MBGMV's expand has with its group members' widths unspecialised)."""

from __future__ import annotations

import itertools
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lorad.gpu_ops import bgmv, fp8_gemm, fused, mbgmm, mbgmv, paged_attention, peer_sum

TARGET = GPUTarget("cuda", 90, 32)
COMMON = dict(stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_table="i32", qk_scale="fp32", cap_log2="fp32",
              window="i32")


def variants():
    """(name, kernel, signature, constexprs): MHA and GQA, bf16 and FP8 pages, FP8 read through either dot operand,
    GQA's sliding windows with capped scores; decode with and without splits."""
    for (group, kv_heads, tpp), pages, dots, sliding in itertools.product(
            ((1, 32, 1), (4, 8, 4)), ("bf16", "fp8"), ("float16", "model"), (False, True)):
        if (pages == "bf16" and dots == "model") or (sliding and group == 1):  # windows: the GQA shapes that have them
            continue
        kv = "*fp8e4nv" if pages == "fp8" else "*bf16"
        f16 = pages == "fp8" and dots == "float16"
        name = f"group={group} pages={pages}{' dots=' + dots if pages == 'fp8' else ''}{' sliding+softcap' if sliding else ''}"
        scalars = dict(UPCAST=False, SLIDING=sliding, SOFTCAP=sliding, KV_FP8=pages == "fp8", F16_DOTS=f16, PRECISION="tf32")
        decode_kind = ("gqa" if group > 1 else "mha") + ("_fp8" if pages == "fp8" else "")
        for splits in (1, 4):
            decode = dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=128, HEAD_PAD=128, KV_HEADS=kv_heads, TOKENS_PER_PAGE=tpp,
                          BLOCK_N=paged_attention.DECODE_BLOCK_N[decode_kind], SPLITS=splits, USE_DOT=True,
                          EARLY=not sliding, **scalars)
            signature = dict(q_ptr="*bf16", kv_ptr=kv, k_table_ptr="*i32", v_table_ptr="*i32", seqs_ptr="*i32",
                             query_start_ptr="*i32", kv_len_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
                             part_lse_ptr="*fp32", kv_scale_ptr="*fp32", **COMMON, **{key: "constexpr" for key in decode})
            yield f"decode {name} splits={splits}", paged_attention._decode_kernel, signature, decode
            h200 = paged_attention.DECODE_LAUNCH_BY_GPU["H200"].get(decode_kind)
            if h200 is not None and f16 and not sliding:  # the H200's launch over FP8 pages (decode_launch)
                block_n, warps, stages = h200
                yield (f"decode {name} splits={splits} H200 launch", paged_attention._decode_kernel, signature,
                       {**decode, "BLOCK_N": block_n}, None, {"num_warps": warps, "num_stages": stages})
        prefill = dict(GROUP=group, HEAD_DIM=128, HEAD_PAD=128, KV_HEADS=kv_heads, TOKENS_PER_PAGE=tpp,
                       BLOCK_M=paged_attention.PREFILL_BLOCK_M, BLOCK_N=64, **scalars)
        signature = dict(q_ptr="*bf16", kv_ptr=kv, k_table_ptr="*i32", v_table_ptr="*i32", tile_seq_ptr="*i32",
                         tile_row_ptr="*i32", query_start_ptr="*i32", query_len_ptr="*i32", kv_len_ptr="*i32",
                         out_ptr="*bf16", kv_scale_ptr="*fp32", **COMMON, **{key: "constexpr" for key in prefill})
        yield f"prefill {name}", paged_attention._prefill_kernel, signature, prefill


def peer_sum_variants():
    """The peer sum in bf16 and float32, Llama's and Gemma's (float32) norm weights, every pointer and stride 16-aligned
    as the engine's are (its loads of the other rank's row then compile to vectors)."""
    for dtype, gemma in (("bf16", False), ("bf16", True), ("fp32", False)):
        signature = dict(partial_ptr=f"*{dtype}", mine_ptr=f"*{dtype}", theirs_ptr=f"*{dtype}", flags_ptr="*i32",
                         their_flags_ptr="*i32", h_ptr=f"*{dtype}", weight_ptr="*fp32" if gemma else f"*{dtype}",
                         out_ptr=f"*{dtype}", stride_pt="i32", stride_ht="i32", stride_ot="i32", eps="fp32")
        constexprs = dict(HIDDEN=5120, BLOCK=8192, SCALE_F32=gemma, TIMEOUT_NS=int(peer_sum.TIMEOUT_S * 1e9))
        signature.update({key: "constexpr" for key in constexprs})
        aligned = {(index,): [["tt.divisibility", 16]] for index in range(11)}
        yield f"peer sum {dtype}{' gemma' if gemma else ''}", peer_sum._peer_sum_add_rms_norm_kernel, signature, constexprs, aligned


def fused_fp8_variants():
    """The norms (plain and with the residual add; Llama's and Gemma's weights) that quantize their rows, with dynamic
    and static scales."""
    for add, gemma, static in itertools.product((False, True), repeat=3):
        signature = dict(h_ptr="*bf16", delta_ptr="*bf16", weight_ptr="*fp32" if gemma else "*bf16", out_ptr="*bf16",
                         rows_ptr="*fp8e4nv", scale_ptr="*fp32", static_ptr="*fp32", stride_ht="i32", stride_dt="i32",
                         stride_ot="i32", stride_rt="i32", eps="fp32")
        constexprs = dict(HIDDEN=4096, BLOCK=4096, SCALE_F32=gemma, ADD=add, STATIC=static, EARLY=add)
        signature.update({key: "constexpr" for key in constexprs})
        yield (f"norm fp8{' add' if add else ''}{' gemma' if gemma else ''}{' static' if static else ''}",
               fused._norm_fp8_kernel, signature, constexprs, None, {"num_warps": fused._warps(4096)})


def early_variants():
    """The kernels of a decode step launched early that the variants above do not cover, each with EARLY on (the
    paged decode attention above has it on without a window, the FP8 norms with the residual add)."""
    aligned = {(index,): [["tt.divisibility", 16]] for index in range(6)}
    norm = dict(HIDDEN=4096, BLOCK=4096, SCALE_F32=False, EARLY=True)
    yield ("early rms norm", fused._rms_norm_kernel,
           dict(x_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", stride_xt="i32", stride_ot="i32", eps="fp32",
                **{key: "constexpr" for key in norm}), norm, None, {"num_warps": fused._warps(4096)})
    yield ("early add rms norm", fused._add_rms_norm_kernel,
           dict(h_ptr="*bf16", delta_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", stride_ht="i32", stride_dt="i32",
                stride_ot="i32", eps="fp32", **{key: "constexpr" for key in norm}), norm, None,
           {"num_warps": fused._warps(4096)})
    rope = dict(HEADS=32, HEADS_PAD=32, KV_HEADS=8, KV_HEADS_PAD=8, HALF=64, HALF_PAD=64, HAS_POSITIONS=False, EARLY=True)
    yield ("early rope", fused._rope_qk_kernel,
           dict(q_ptr="*bf16", k_ptr="*bf16", q_out_ptr="*bf16", k_out_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                positions_ptr="*i64", **{f"stride_{name}": "i32" for name in ("qt", "qh", "kt", "kh", "qot", "qoh", "kot",
                                                                                "koh", "cos")},
                **{key: "constexpr" for key in rope}), rope, None, {"num_warps": 4})
    for kernel in (fused._silu_mul_kernel, fused._gelu_tanh_mul_kernel):
        gated = dict(BLOCK=fused.SILU_BLOCK, EARLY=True)
        yield (f"early {kernel.__name__}", kernel,
               dict(gate_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16", stride_gt="i32", stride_ut="i32", stride_ot="i32",
                    width="i32", **{key: "constexpr" for key in gated}), gated, None, {"num_warps": 4})
    quantize = dict(STATIC=False, BLOCK=4096, EARLY=True)
    yield ("early quantize rows", fp8_gemm._quantize_rows_kernel,
           dict(x_ptr="*bf16", out_ptr="*fp8e4nv", scale_ptr="*fp32", static_ptr="*fp32", K="i32", stride_x="i32",
                stride_out="i32", **{key: "constexpr" for key in quantize}), quantize, aligned, {"num_warps": 8})
    config = fp8_gemm.rows_gemm_config(64, 4096, 12288, 228 * 1024)
    rows = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=True, HAS_BIAS=False,
                EARLY=True)
    yield ("early fp8 rows gemm", fp8_gemm._rows_gemm_kernel,
           dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_scale_ptr="*fp32", bias_ptr="*fp32",
                y_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32",
                **{key: "constexpr" for key in rows}), rows, aligned,
           {"num_warps": config.num_warps, "num_stages": config.num_stages})
    write = dict(ROW=4096, PAGE=8192, BLOCK=4096, KV_FP8=True, EARLY=True)
    yield ("early write kv", paged_attention._write_kv_kernel,
           dict(k_ptr="*bf16", v_ptr="*bf16", kv_ptr="*fp8e4nv", dest_k_ptr="*i32", dest_v_ptr="*i32",
                dest_offset_ptr="*i32", kv_scale_ptr="*fp32", stride_kt="i32", stride_vt="i32",
                **{key: "constexpr" for key in write}), write, None, {"num_warps": 8})
    combine = dict(HEADS=32, HEAD_DIM=128, HEAD_PAD=128, SPLITS=4, EARLY=True)
    yield ("early combine", paged_attention._combine_kernel,
           dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", seqs_ptr="*i32", query_start_ptr="*i32", out_ptr="*bf16",
                stride_ot="i32", **{key: "constexpr" for key in combine}), combine, None, {"num_warps": 4})
    config = mbgmv.decode_config(4096, 4096, 16, pdl=True)
    shrink = dict(PAGE=4096, BLOCK_R=config.shrink_r, BLOCK_K=config.block_k, K_TILES=1, ALIGNED=True, GROUPED=True,
                  PDL=True, EARLY=True)
    ints = ("in_dim", "max_rank", "width", "num_rows", "splits", "rank_blocks", "k_per_split", "stride_xt", "stride_xk",
            "slot_stride", "table_offset", "chunks_in", "member_stride")
    yield ("early mbgmv shrink", mbgmv._mbgmv_shrink_kernel,
           dict(x_ptr="*bf16", v_ptr="*fp32", row_slot_ptr="*i32", rank_ptr="*i32", a_start_ptr="*i32",
                page_ids_ptr="*i32", pages_ptr="*bf16", **{name: "i32" for name in ints},
                **{key: "constexpr" for key in shrink}), shrink, None,
           {"num_warps": config.num_warps, "num_stages": 1})
    expand = dict(PAGE=4096, BLOCK_R=config.expand_r, BLOCK_N=config.block_n, SPLITS=2, ALIGNED=True, GROUPED=True,
                  PDL=True, EARLY=True)
    ints = ("out_dim", "max_rank", "width", "num_rows", "splits", "n_tiles", "stride_yt", "stride_yn", "slot_stride",
            "table_offset", "chunks_out", "member_stride", "out_dim1", "out_dim2", "chunks_out1", "chunks_out2", "col1",
            "col2")
    yield ("early mbgmv expand", mbgmv._mbgmv_expand_kernel,
           dict(v_ptr="*fp32", y_ptr="*bf16", row_slot_ptr="*i32", rank_ptr="*i32", b_start_ptr="*i32",
                page_ids_ptr="*i32", pages_ptr="*bf16", **{name: "i32" for name in ints},
                **{key: "constexpr" for key in expand}), expand, None,
           {"num_warps": config.expand_warps, "num_stages": 1, "launch_pdl": True})


def as_the_jit_specialises(kernel, pointers: dict, constexprs: dict, values: dict):
    """(signature, constexprs, attrs) of `kernel` for a call with these pointer types and integer values, as Triton's
    JIT compiles it: an integer argument equal to 1 becomes a constant, one divisible by 16 is known to be (both unless
    the kernel does not specialise it), every pointer is 16-byte aligned (the engine's tensors are)."""
    signature, attrs, constants = {}, {}, dict(constexprs)
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in kernel.do_not_specialize or (values[name] != 1 and values[name] % 16):
            signature[name] = "i32"
        elif values[name] == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


# The LoRA kernels' arguments for a call on the 7B shape (4096 -> 4096, rank 16, pages of 4096 elements, a fused
# q|k|v output 12288 wide): pointer types, and the integers the JIT specialises on
LORA_POINTERS = dict(rank_ptr="*i32", a_start_ptr="*i32", b_start_ptr="*i32", page_ids_ptr="*i32", pages_ptr="*bf16",
                     row_slot_ptr="*i32", rows_ptr="*i32", meta_ptr="*i32", tiles_ptr="*i32", ready_ptr="*i32",
                     error_ptr="*i32", x_ptr="*bf16", y_ptr="*bf16", v_ptr="*fp32", v1_ptr="*fp32", v2_ptr="*fp32")
LORA_INTS = dict(in_dim=4096, out_dim=4096, max_rank=16, width=16, num_rows=64, splits=2, rank_blocks=2, k_per_split=2048,
                 stride_xt=12288, stride_xk=1, stride_yt=12288, stride_yn=1, slot_stride=224, table_offset=3, chunks_in=1,
                 chunks_out=1, member_stride=2048, num_segments=8, num_tiles=40, layer=3, member_blocks=32, n_per_program=4)


def lora_wide_load_variants():
    """(name, kernel, constexprs, options): the shrinks (MBGMV's, grouped and launched early; MBGMM's over a prefill
    graph's tile list; BGMV's) and MBGMM's expand."""
    config = mbgmv.decode_config(4096, 4096, 16, pdl=True)
    shrink = dict(PAGE=4096, BLOCK_R=config.shrink_r, BLOCK_K=config.block_k, K_TILES=1, ALIGNED=True, GROUPED=True,
                  PDL=True, EARLY=True)
    yield "mbgmv shrink", mbgmv._mbgmv_shrink_kernel, shrink, {"num_warps": config.num_warps, "num_stages": 1}
    common = dict(PAGE=4096, BLOCK_M=mbgmm.GRAPH_BLOCK_M, BLOCK_R=16, ALIGNED=True, PRECISION="tf32", UPCAST=False,
                  USE_TILES=True)
    yield ("mbgmm shrink", mbgmm._mbgmm_shrink_kernel,
           dict(common, BLOCK_K=mbgmm.BLOCK_K, STREAM=False, TIMEOUT_NS=1, GROUPED=True), {"num_warps": 4, "num_stages": 3})
    yield "mbgmm expand", mbgmm._mbgmm_expand_kernel, dict(common, BLOCK_N=mbgmm.BLOCK_N), {"num_warps": 4, "num_stages": 3}
    yield "bgmv shrink", bgmv._bgmv_shrink_kernel, dict(PAGE=4096, BLOCK_R=16, BLOCK_K=256, ALIGNED=True), {"num_warps": 4}


def narrow_loads(kernel, constexprs: dict, options: dict) -> int:
    """The 2-byte global loads of `kernel` compiled for sm90 as the JIT compiles it for a call with LORA_INTS."""
    signature, constants, attrs = as_the_jit_specialises(kernel, LORA_POINTERS, constexprs, LORA_INTS)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs), target=TARGET,
                              options=options)
    return len(re.findall(r"ld\.global[\w:.]*\.b16\b", compiled.asm["ptx"]))


def main() -> int:
    if type(paged_attention._decode_kernel).__name__ != "JITFunction":
        print("the kernels were decorated for the interpreter (TRITON_INTERPRET is set)", file=sys.stderr)
        return 2
    failed = 0
    for name, kernel, signature, constexprs, *extra in [*variants(), *peer_sum_variants(), *fused_fp8_variants(),
                                                        *early_variants()]:
        attrs, options = (extra + [None, None])[:2]
        try:
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            triton.compile(source, target=TARGET, options=options)
            print(f"ok      {name}")
        except Exception as error:  # noqa: BLE001 - every variant reported, the first error's text in full
            failed += 1
            print(f"FAILED  {name}: {str(error)[:4000]}")
    for name, kernel, constexprs, options in lora_wide_load_variants():
        try:
            narrow = narrow_loads(kernel, constexprs, options)
        except Exception as error:  # noqa: BLE001
            narrow = f"not compiled: {str(error)[:4000]}"
        if narrow == 0:
            print(f"ok      lora wide loads {name}")
        else:
            failed += 1
            print(f"FAILED  lora wide loads {name}: {narrow} 2-byte global loads")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
