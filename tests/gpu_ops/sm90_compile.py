"""Compiles the paged attention kernels, the two-rank peer sum and the norms that quantize their rows for FP8 for
the H100 (sm90) on a machine without a GPU, every variant of constexprs the engine launches, through Triton's whole pipeline (its bundled ptxas included): the interpreter
that runs the kernels in CI does not apply the compiler's checks (a helper's return types, say), so a kernel
can pass every CPU test and fail to compile on the GPU. Run by test_compile_sm90.py in a process of its own
(the interpreter is chosen when a kernel module is imported). Prints one line per variant; exit status 1 if one
fails."""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lorad.gpu_ops import fused, paged_attention, peer_sum

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
                          **scalars)
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
        constexprs = dict(HIDDEN=4096, BLOCK=4096, SCALE_F32=gemma, ADD=add, STATIC=static)
        signature.update({key: "constexpr" for key in constexprs})
        yield (f"norm fp8{' add' if add else ''}{' gemma' if gemma else ''}{' static' if static else ''}",
               fused._norm_fp8_kernel, signature, constexprs, None, {"num_warps": fused._warps(4096)})


def main() -> int:
    if type(paged_attention._decode_kernel).__name__ != "JITFunction":
        print("the kernels were decorated for the interpreter (TRITON_INTERPRET is set)", file=sys.stderr)
        return 2
    failed = 0
    for name, kernel, signature, constexprs, *extra in [*variants(), *peer_sum_variants(), *fused_fp8_variants()]:
        attrs, options = (extra + [None, None])[:2]
        try:
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            triton.compile(source, target=TARGET, options=options)
            print(f"ok      {name}")
        except Exception as error:  # noqa: BLE001 - every variant reported, the first error's text in full
            failed += 1
            print(f"FAILED  {name}: {str(error)[:4000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
