"""FP8 (gpu_ops/fp8.py): weights quantized per output channel and their GEMMs, rows quantized per token, and
the FP8 KV pages written and read by the paged attention kernels, against references on fresh random inputs:

- the quantizers' error bounds, Fp8Weight's fusion and the KV conversions (CPU, CI);
- the FP8 KV reference write/read against float64 attention over the stored values (CPU, CI);
- the Triton kernels (gpu_ops/fp8_gemm.py's row quantization, the gemv over FP8 weights, KV write, decode and prefill attention over
  FP8 pages; the norms of gpu_ops/fused.py that quantize the rows they write) in Triton's
  interpreter, which converts float8e4nv as torch does (CPU, CI, when triton imports);
- the compiled kernels and torch._scaled_mm on the GPU (`pytest -m gpu`, compute capability >= 8.9).
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import interpreted, needs_interpreter  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import fp8, fp8_gemm, fused, gemv, launch, paged_attention  # noqa: E402
from lorad.gpu_ops.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from test_paged_attention import MIXED, build_case, relative_error, truth  # noqa: E402

E4M3_RELATIVE = 2.0**-4  # half the spacing of 3 mantissa bits, relative to the value (normal range)
E4M3_SUBNORMAL_STEP = 2.0**-9  # the spacing below the smallest normal (2^-6), in units of the scale


@pytest.fixture(scope="module")
def kernels():
    interpreted(fp8_gemm._quantize_rows_kernel, gemv, fp8_gemm, paged_attention, fused)
    return fp8_gemm, gemv, paged_attention


def rounding_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest error round-to-nearest E4M3 may make on `values` stored over `scale` (broadcast)."""
    return values.abs() * E4M3_RELATIVE + scale * E4M3_SUBNORMAL_STEP / 2 + 1e-12


# ---------------------------------------------------------------------------------------------------
# CPU: quantizers and references


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_weight_per_channel_scales_and_error_bound(dtype):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 80, generator=generator) * torch.logspace(-3, 2, 96)[:, None]).to(dtype)
    weight[5] = 0  # a row of zeros keeps a finite scale
    quantized = fp8.quantize_weight(weight)
    assert quantized.weight.dtype == torch.float8_e4m3fn and quantized.scale.dtype == torch.float32
    amax = weight.float().abs().amax(dim=1)
    expected_scale = amax.clamp(min=fp8.MIN_AMAX) / 448
    assert torch.allclose(quantized.scale, expected_scale, rtol=1e-6)
    # every non-zero row's largest element maps to +-448 exactly
    stored_amax = quantized.weight.float().abs().amax(dim=1)
    assert torch.equal(stored_amax[amax > 0], torch.full_like(stored_amax[amax > 0], 448.0))
    error = (quantized.dequantize(torch.float32) - weight.float()).abs()
    assert (error <= rounding_bound(weight.float(), quantized.scale[:, None])).all()
    assert torch.isfinite(quantized.dequantize(torch.float32)).all()


def test_quantize_rows_ref_dynamic_and_static():
    x = torch.randn(7, 64) * torch.tensor([1e-2, 1, 3, 100, 0.5, 7, 1e3])[:, None]
    rows, scale = fp8.quantize_rows_ref(x)
    assert scale.shape == (7, 1)
    assert torch.allclose(scale[:, 0], x.abs().amax(dim=1) / 448, rtol=1e-6)
    assert (((rows.float() * scale) - x).abs() <= rounding_bound(x, scale)).all()
    static = torch.tensor([0.5])
    rows, scale = fp8.quantize_rows_ref(x, static)
    assert torch.equal(scale, torch.full((7, 1), 0.5))
    assert rows.float().abs().max() == 448  # the rows past 448 * 0.5 saturate instead of turning NaN
    assert not torch.isnan(rows.float()).any()


def test_fp8_linear_ref_error_against_the_full_precision_product():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 256, generator=generator)
    weight = torch.randn(128, 256, generator=generator) * 0.05
    bias = torch.randn(128, generator=generator)
    exact = torch.nn.functional.linear(x, weight, bias)
    quantized = fp8.quantize_weight(weight)
    # weight-only rounding: a relative error of about 2^-4 / sqrt(3) per element, averaging out over K
    assert relative_error(fp8.fp8_linear_ref(x, quantized, bias), exact.double()) < 0.03
    # rows quantized too (the GPU path's arithmetic): about twice that
    assert relative_error(fp8.scaled_mm_ref(x, quantized, bias), exact.double()) < 0.05
    assert relative_error(fp8.scaled_mm_ref(x, quantized), fp8.fp8_linear_ref(x, quantized).double()) < 0.05


def test_fp8_weight_cat_and_checks():
    parts = [fp8.quantize_weight(torch.randn(16, 32) * s) for s in (1.0, 10.0, 0.1)]
    fused = fp8.Fp8Weight.cat(parts)
    assert fused.shape == (48, 32)
    assert torch.equal(fused.scale, torch.cat([p.scale for p in parts]))
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))
    assert fused.input_scale is None and fused.nbytes == 48 * 32 + 48 * 4
    statics = [fp8.Fp8Weight(p.weight, p.scale, torch.tensor([s])) for p, s in zip(parts, (0.1, 0.3, 0.2))]
    assert fp8.Fp8Weight.cat(statics).input_scale.tolist() == [pytest.approx(0.3)]
    with pytest.raises(ValueError, match="mix static and dynamic"):
        fp8.Fp8Weight.cat([statics[0], parts[1]])
    with pytest.raises(ValueError, match="2-D"):
        fp8.Fp8Weight(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8.Fp8Weight(torch.zeros(4, 4).to(fp8.FP8), torch.ones(3))


def test_kv_conversions_round_trip_and_saturate():
    x = torch.randn(5, 2, 16).bfloat16() * 3
    scale = torch.tensor(0.25)
    stored = fp8.to_kv(x, scale)
    assert stored.dtype == torch.float8_e4m3fn
    back = fp8.from_kv(stored, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert ((back.float() - x.float()).abs() <= rounding_bound(x.float(), scale) + 2e-2 * x.float().abs()).all()
    huge = fp8.to_kv(torch.tensor([1e6, -1e6]), torch.tensor(1.0))
    assert huge.float().tolist() == [448.0, -448.0]


def fp8_case(heads, kv_heads, head_dim, tokens_per_page, shapes, dtype, device, scales, layers=2, seed=0):
    """A paged case whose pages hold FP8: K and V written through write_kv_ref (the reference's quantizer);
    case.keys/values keep the stored values (dequantized), which the float64 truth then attends over."""
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, shapes, dtype, device, layers=layers, seed=seed)
    view = torch.full(case.kv_view.shape, float("nan"), device=device).to(fp8.FP8)
    from lorad.gpu_ops.attention import AttentionBatch

    table = case.batch.block_table.cpu().numpy()
    whole = AttentionBatch.from_block_table(table, [(kv_len, kv_len) for kv_len, _ in shapes], tokens_per_page, device)
    for layer in range(layers):
        k = torch.cat([keys[layer] for keys in case.keys]).to(device)
        v = torch.cat([values[layer] for values in case.values]).to(device)
        write_kv_ref(view, layer, k, v, whole, scales)
    case.keys = [fp8.from_kv(fp8.to_kv(keys, scales[:, 0, None, None, None].cpu()), scales[:, 0, None, None, None].cpu(), torch.float64)
                 for keys in case.keys]
    case.values = [fp8.from_kv(fp8.to_kv(values, scales[:, 1, None, None, None].cpu()), scales[:, 1, None, None, None].cpu(), torch.float64)
                   for values in case.values]
    case.kv_view = view
    return case


SCALES = torch.tensor([[0.5, 0.02], [0.01, 0.3]])  # [layers, K|V]: values of ~1 stored at 2 to 100x the scale


def test_fp8_kv_reference_write_and_read():
    """write_kv_ref stores K / scale in FP8 (the pages hold what to_kv gives); paged_attention_ref reads them
    back times the scale: the float64 attention over the stored values, within float32 rounding, and over the
    values before FP8 within E4M3's rounding."""
    heads, kv_heads, head_dim = 4, 2, 16
    shapes = [(9, 1), (7, 7), (13, 5)]
    exact = build_case(heads, kv_heads, head_dim, 8, shapes, torch.float32, torch.device("cpu"))
    case = fp8_case(heads, kv_heads, head_dim, 8, shapes, torch.float32, torch.device("cpu"), SCALES)
    assert case.kv_view.dtype == torch.float8_e4m3fn and not torch.isnan(case.kv_view[1:3].float()).all()
    q = torch.randn(13, heads, head_dim)
    for layer in range(2):
        got = paged_attention_ref(q, case.kv_view, layer, case.batch, 0.25, kv_scales=SCALES)
        assert relative_error(got, truth(case, q, layer, 0.25)) < 1e-5
        assert relative_error(got, truth(exact, q, layer, 0.25)) < 0.08
    with pytest.raises(TypeError):  # FP8 pages without their scales
        paged_attention_ref(q, case.kv_view, 0, case.batch, 0.25)


# ---------------------------------------------------------------------------------------------------
# CPU: the Triton kernels in the interpreter


def representable(shape, exponents, generator) -> torch.Tensor:
    """Values whose quotient by 2^exponent (per row) is an E4M3 value: the kernels' conversion to FP8 is then exact.
    Triton's interpreter (3.9) rounds float32 -> E4M3 half-up without carrying into the exponent (124 -> 64), so
    the interpreted tests store only values that need no rounding and compare bytes; the hardware's rounding
    (round to nearest even, saturated) is checked on the GPU."""
    codes = torch.randn(*shape, generator=generator).mul(60).clamp(-448, 448).to(fp8.FP8).float()
    return codes * torch.exp2(exponents.float()).reshape(-1, *[1] * (len(shape) - 1))


@needs_interpreter
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_rows_interpreted(static, kernels):
    gemm, _, _ = kernels
    generator = torch.Generator().manual_seed(2)
    x = representable((5, 200), torch.tensor([-9, 0, 4, -2, 3]), generator)
    x[:, 17] = 448 * torch.exp2(torch.tensor([-9.0, 0, 4, -2, 3]))  # each row's amax: its scale is its power of two
    x[3] = 0  # a row of zeros
    x = x.bfloat16()
    static_scale = torch.tensor([2.0**-9]) if static else None  # the other rows scaled up: many saturate
    rows, scale = gemm.quantize_rows(x, static_scale)
    expected_rows, expected_scale = fp8.quantize_rows_ref(x, static_scale)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(rows.view(torch.uint8), expected_rows.view(torch.uint8))


@needs_interpreter
@pytest.mark.parametrize("k", [256, 200])
def test_gemv_fp8_weights_interpreted(k, kernels):
    _, gemv_module, _ = kernels
    x = torch.randn(1, k).bfloat16()
    weight = fp8.quantize_weight(torch.randn(24, k) * 0.1)
    bias = torch.randn(24).bfloat16()
    got = gemv_module.gemv(x, weight.weight, bias, scale=weight.scale)
    expected = torch.nn.functional.linear(x.float(), weight.dequantize(torch.float32), bias.float())
    assert relative_error(got, expected.double()) < 1e-2


@needs_interpreter
@pytest.mark.parametrize("tokens,width,columns", [(3, 512, 72), (70, 80, 72), (5, 600, 72), (5, 80, 4112), (20, 300, 4112)],
                         ids=["even_k", "two_row_tiles", "ragged_k", "wide_few_rows", "wide"])
def test_fp8_rows_gemm_interpreted(tokens, width, columns, kernels):
    """The decode batches' FP8 GEMM at each of rows_gemm_config's tiles (72 columns: o and down's narrow tiles, a
    partial one; 4112: the wide projections' tiles, to 16 rows and past): every row and column tile, K in several
    reads and past the last full one (600 in 256-deep reads, 300 in 128-deep), the row and channel scales and the
    bias, against the same product in float64."""
    gemm, _, _ = kernels
    generator = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens, width, generator=generator).mul(40).clamp(-448, 448).to(fp8.FP8)
    row_scale = torch.rand(tokens, 1, generator=generator) + 0.5
    weight = fp8.quantize_weight(torch.randn(columns, width, generator=generator) * 0.1)
    bias = torch.randn(columns, generator=generator).bfloat16()
    got = gemm.fp8_rows_gemm(rows, row_scale, weight, bias, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, columns)
    expected = (rows.double() * row_scale.double()) @ (weight.weight.double() * weight.scale.double()[:, None]).t()
    assert relative_error(got, expected + bias.double()) < 4e-3  # bf16 output rounding


@needs_interpreter
def test_write_kv_fp8_interpreted(kernels):
    """The kernel stores exactly what write_kv_ref stores in FP8 pages, and nothing else."""
    _, _, attention_kernels = kernels
    heads, kv_heads, head_dim = 4, 2, 16
    case = fp8_case(heads, kv_heads, head_dim, 8, [(9, 1), (7, 7), (13, 5)], torch.bfloat16, torch.device("cpu"), SCALES)
    generator = torch.Generator().manual_seed(4)
    k = representable((13, kv_heads, head_dim), torch.full((13,), -7), generator).bfloat16()  # K's scale: 2^-7
    qkv = representable((13, (heads + 2 * kv_heads) * head_dim), torch.full((13,), -3), generator)
    qkv[::2] *= 4  # V's scale is 2^-5: these rows' largest values saturate at 448 * 2^-5
    v = qkv.bfloat16()[:, (heads + kv_heads) * head_dim :].view(13, kv_heads, head_dim)
    expected = case.kv_view.clone()
    scales = torch.tensor([[1.0, 1.0], [2.0**-7, 2.0**-5]])
    write_kv_ref(expected, 1, k, v, case.batch, scales)
    assert (expected[1:].float().abs() == 448).any()
    attention_kernels.write_kv(case.kv_view, 1, k, v, case.batch, scales)
    assert torch.equal(case.kv_view.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        attention_kernels.write_kv(case.kv_view, 1, k, v, case.batch)


@needs_interpreter
@pytest.mark.parametrize("layout", [(4, 4, 16, 2), (8, 2, 16, 8), (4, 2, 24, 6)], ids=["mha", "gqa4", "gqa2_d24"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dots", ["float16", "model"])
def test_attention_fp8_pages_interpreted(layout, dtype, dots, kernels, monkeypatch):
    """Decode and prefill kernels over FP8 pages against float64 attention over the stored values (the kernel's
    only rounding is then the model dtype's, or float16's for the query and P) and against paged_attention_ref over
    the same pages, with either dot operand (a float32 model always widens to float32)."""
    _, _, attention_kernels = kernels
    monkeypatch.setattr(attention_kernels, "FP8_KV_DOTS", dots)
    heads, kv_heads, head_dim, tokens_per_page = layout
    case = fp8_case(heads, kv_heads, head_dim, tokens_per_page, MIXED, dtype, torch.device("cpu"), SCALES)
    total = sum(query_len for _, query_len in MIXED)
    q = torch.randn(total, heads, head_dim).to(dtype)
    for layer in range(2):
        out = torch.full((total, heads * head_dim), float("nan"), dtype=dtype)
        got = attention_kernels.attention(q, case.kv_view, layer, case.batch, 0.3, out=out, kv_scales=SCALES)
        limit = 1e-5 if dtype == torch.float32 else 2e-2
        assert relative_error(got, truth(case, q, layer, 0.3)) < limit
        reference = paged_attention_ref(q, case.kv_view, layer, case.batch, 0.3, kv_scales=SCALES)
        assert relative_error(got, reference.double()) < limit


@needs_interpreter
def test_attention_fp8_pages_at_the_h200_launch_interpreted(kernels, monkeypatch):
    """On a device named as the H200 the decode kernel over FP8 pages of an MHA model reads 64 positions a step
    (DECODE_LAUNCH_BY_GPU): the same results against float64 attention, contexts past one step and ragged."""
    _, _, attention_kernels = kernels
    monkeypatch.setattr(launch, "gpu_name", lambda device: "NVIDIA H200")
    assert attention_kernels.decode_launch("mha_fp8", torch.device("cpu"))[0] == 64
    heads, kv_heads, head_dim, tokens_per_page = 4, 4, 16, 2
    shapes = [(150, 1), (3, 1), (64, 1), (70, 6)]
    case = fp8_case(heads, kv_heads, head_dim, tokens_per_page, shapes, torch.bfloat16, torch.device("cpu"), SCALES)
    total = sum(query_len for _, query_len in shapes)
    q = torch.randn(total, heads, head_dim).bfloat16()
    got = attention_kernels.attention(q, case.kv_view, 1, case.batch, 0.3, kv_scales=SCALES)
    assert relative_error(got, truth(case, q, 1, 0.3)) < 2e-2


@needs_interpreter
def test_prefill_fp8_pages_k_scale_zero_interpreted(kernels):
    """A layer whose K scale is 0 (its stored K all read as 0): every row attends evenly over what it sees, as the
    reference does. The prefill kernel multiplies its scale into the exponents, after the causal mask's -inf: without
    its floor on the scale that product is NaN."""
    _, _, attention_kernels = kernels
    shapes = [(20, 20), (37, 9)]
    scales = torch.tensor([[0.0, 0.3], [0.0, 0.3]])
    case = fp8_case(4, 2, 16, 2, shapes, torch.bfloat16, torch.device("cpu"), scales)
    q = torch.randn(29, 4, 16).bfloat16()
    got = attention_kernels.attention(q, case.kv_view, 1, case.batch, 0.3, kv_scales=scales)
    assert torch.isfinite(got.float()).all()
    reference = paged_attention_ref(q, case.kv_view, 1, case.batch, 0.3, kv_scales=scales)
    assert relative_error(got, reference.double()) < 2e-2


def test_decode_launch_by_gpu(monkeypatch):
    """A GPU with its own entry takes it for the kinds it names; others, and other kinds, the defaults."""
    from lorad.gpu_ops import paged_attention

    cpu = torch.device("cpu")
    assert paged_attention.decode_launch("mha_fp8", cpu) == (paged_attention.DECODE_BLOCK_N["mha_fp8"],
                                                              *paged_attention.DECODE_LAUNCH["mha_fp8"])
    monkeypatch.setattr(launch, "gpu_name", lambda device: "NVIDIA H200")
    assert paged_attention.decode_launch("mha_fp8", cpu) == (64, 1, 4)
    for kind in ("gqa_fp8", "mha"):  # GQA over FP8 pages and bf16 pages: the defaults
        assert paged_attention.decode_launch(kind, cpu) == (paged_attention.DECODE_BLOCK_N[kind],
                                                            *paged_attention.DECODE_LAUNCH[kind])
    monkeypatch.setattr(launch, "gpu_name", lambda device: "NVIDIA H200 NVL")
    assert paged_attention.decode_launch("mha_fp8", cpu) == (64, 1, 4)
    for other in ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB"):  # GH200's GPU is an H100 beside a Grace CPU
        monkeypatch.setattr(launch, "gpu_name", lambda device, name=other: name)
        assert paged_attention.decode_launch("mha_fp8", cpu) == (128, 2, 3)


def test_one_row_takes_the_gemv_but_wide_projections_on_an_h200(monkeypatch):
    """takes_gemv by the device's name, and what the Triton ops then say of their FP8 GEMM (/v1/status)."""
    from lorad.daemon.model import ops as ops_module
    from lorad.daemon.model.quantization import GPU_GEMM, GPU_GEMM_WIDE_ONE_ROW

    cpu = torch.device("cpu")
    for name, wide_gemv in (("", True), ("NVIDIA H100 80GB HBM3", True), ("NVIDIA GH200 480GB", True),
                            ("NVIDIA H200", False), ("NVIDIA H200 NVL", False)):
        monkeypatch.setattr(launch, "gpu_name", lambda device, name=name: name)
        assert fp8_gemm.takes_gemv(1, 4096, cpu)  # o, down: the gemv everywhere
        assert fp8_gemm.takes_gemv(1, 3 * 4096, cpu) == wide_gemv
        assert not fp8_gemm.takes_gemv(2, 4096, cpu)
        assert ops_module.TritonOps(cpu, 64, 16).fp8_gemm == (GPU_GEMM if wide_gemv else GPU_GEMM_WIDE_ONE_ROW)


@needs_interpreter
def test_one_row_of_a_wide_projection_on_an_h200_is_quantized_by_its_norm_interpreted(kernels, monkeypatch):
    """On an H200 one row of q|k|v is quantized by the input norm and multiplied by the rows kernel (no gemv, no
    quantization launch), within the bf16 output's rounding of the product of its FP8 row and weight; a narrow
    projection's row still takes the gemv."""
    from lorad.daemon.model import ops as ops_module

    gemm, gemv_module, _ = kernels
    monkeypatch.setattr(launch, "gpu_name", lambda device: "NVIDIA H200")
    generator = torch.Generator().manual_seed(13)
    quantized = fp8.quantize_weight(torch.randn(4160, 64, generator=generator) * 0.1)  # wider than 4096 columns
    wide = ops_module.Fp8Weight(quantized.weight, quantized.scale)
    x = torch.randn(1, 64, generator=generator).bfloat16()
    norm_weight = torch.randn(64, generator=generator).bfloat16()
    ops = ops_module.TritonOps(torch.device("cpu"), 64, 16)
    gemv_call = gemv_module.gemv
    monkeypatch.setattr(gemm.gemv, "gemv", lambda *args, **kwargs: pytest.fail("took the gemv"))
    monkeypatch.setattr(gemm, "quantize_rows", lambda *args: pytest.fail("quantized the row again"))
    normed = ops.rms_norm(x, norm_weight, 1e-5, feeds=wide)
    got = ops.linear(normed, wide)
    assert got.shape == (1, 4160)
    rows, scale = fused.rms_norm_fp8(x, norm_weight, 1e-5)[1:]  # the interpreter's E4M3 rounding: compare its rows
    expected = (rows.double() * scale.double()) @ (wide.weight.double() * wide.scale.double()[:, None]).t()
    assert relative_error(got, expected) < 4e-3  # bf16 output rounding
    monkeypatch.setattr(gemm.gemv, "gemv", gemv_call)
    narrow = ops_module.Fp8Weight(quantized.weight[:48].contiguous(), quantized.scale[:48].contiguous())
    assert relative_error(ops.linear(normed, narrow), fp8.fp8_linear_ref(normed.float(), narrow).double()) < 1e-2


def test_rows_gemm_config_by_projection_width():
    """Narrow projections (o, down) in 32-column tiles up to 64 rows, 64 past; wide ones 16 by 64 up to 16 rows, 64 by
    64 with K 128 deep past; stages cut to what the shared memory holds, K to its depth."""
    from lorad.gpu_ops.fp8_gemm import RowsGemmConfig, rows_gemm_config

    smem = 227 * 1024
    assert rows_gemm_config(2, 4096, 4096, smem) == RowsGemmConfig(64, 32, 256, 4, 6)
    assert rows_gemm_config(64, 11008, 4096, smem) == RowsGemmConfig(64, 32, 256, 4, 6)
    assert rows_gemm_config(65, 4096, 4096, smem) == RowsGemmConfig(64, 64, 256, 4, 6)
    assert rows_gemm_config(16, 4096, 12288, smem) == RowsGemmConfig(16, 64, 256, 4, 3)
    assert rows_gemm_config(17, 4096, 22016, smem) == RowsGemmConfig(64, 64, 128, 4, 4)
    assert rows_gemm_config(64, 80, 12288, smem).block_k == 128  # K no deeper than it is
    assert rows_gemm_config(64, 4096, 4096, 100 * 1024).num_stages == 3  # 24 KiB a stage in 100 KiB


@needs_interpreter
def test_fp8_pages_float16_dots_saturate_the_query_interpreted(kernels):
    """Float16 dots round the query to float16: an element past its range saturates there (finite scores) rather
    than becoming inf; an unknown choice of operand is refused."""
    _, _, attention_kernels = kernels
    case = fp8_case(4, 4, 16, 2, MIXED, torch.bfloat16, torch.device("cpu"), SCALES)
    total = sum(query_len for _, query_len in MIXED)
    q = torch.randn(total, 4, 16).bfloat16()
    q[:, :, 0] = 1e5
    got = attention_kernels.attention(q, case.kv_view, 0, case.batch, 0.3, kv_scales=SCALES)
    assert torch.isfinite(got.float()).all()
    meta = attention_kernels.AttentionMeta.build(case.batch, 2, "cpu")
    table = case.batch.block_table
    with pytest.raises(ValueError, match="fp8_dots must be one of"):
        attention_kernels.decode_attention(q, case.kv_view, table[0, 0], table[0, 1], meta.decode_seqs, meta.query_start,
                                           meta.kv_len, got, 0.3, num_seqs=meta.num_decode, kv_scale=SCALES[0], fp8_dots="fp8")


@needs_interpreter
def test_decode_fp8_pages_split_interpreted(kernels):
    """Flash-decoding partials over FP8 pages: V's scale applied before the combine, once."""
    _, _, attention_kernels = kernels
    shapes = [(200, 1), (3, 1), (129, 1)]
    case = fp8_case(8, 2, 16, 8, shapes, torch.float32, torch.device("cpu"), SCALES)
    meta = attention_kernels.AttentionMeta.build(case.batch, 8, "cpu")
    q = torch.randn(3, 8, 16)
    table = case.batch.block_table
    for splits in (1, 4):
        out = torch.full((3, 8 * 16), float("nan"))
        attention_kernels.decode_attention(
            q, case.kv_view, table[1, 0], table[1, 1], meta.decode_seqs, meta.query_start, meta.kv_len, out, 0.3,
            num_seqs=meta.num_decode, splits=splits, block_n=32, kv_scale=SCALES[1],
        )
        assert relative_error(out, truth(case, q, 1, 0.3)) < 1e-5


@needs_interpreter
def test_triton_ops_linear_takes_fp8_weights_interpreted(kernels):
    """TritonOps.linear on an Fp8Weight: one row through the interpreted gemv (x kept in bf16), more rows quantized
    per token by the interpreted kernel and multiplied by torch._scaled_mm (which torch also runs on the CPU, with the
    GPU's layouts: row-major rows, a column-major weight, rowwise scales), against the references."""
    from lorad.daemon.model import ops as ops_module

    gemm, _, _ = kernels
    generator = torch.Generator().manual_seed(6)
    quantized = fp8.quantize_weight(torch.randn(48, 64, generator=generator) * 0.1)
    # the class ops.py dispatches on (gpu_ops/fp8.py may have been reloaded for the interpreter since ops imported it)
    weight = ops_module.Fp8Weight(quantized.weight, quantized.scale)
    rows = representable((5, 64), torch.tensor([-4, 0, 2, -1, 3]), generator)
    rows[:, 3] = 448 * torch.exp2(torch.tensor([-4.0, 0, 2, -1, 3]))  # per-token scales exact: no rounding in the interpreter
    rows = rows.bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    ops = ops_module.TritonOps(torch.device("cpu"), 64, 16)
    one = ops.linear(rows[:1], weight, bias)
    assert relative_error(one, fp8.fp8_linear_ref(rows[:1].float(), weight, bias.float()).double()) < 1e-2
    many = ops.linear(rows, weight, bias)
    assert many.dtype == torch.bfloat16 and many.shape == (5, 48)
    assert relative_error(many, fp8.scaled_mm_ref(rows.float(), weight, bias.float()).double()) < 1e-2


def check_norms_fp8(tokens, hidden, dtype, device, static, gemma=False, seed=0):
    """rms_norm_fp8 and add_rms_norm_fp8: h the plain kernel's to the bit, the normed rows the plain kernels' (to the
    bit in the interpreter; compiled, within one rounding: Triton may lay the row out otherwise for the FP8 stores,
    and sum its squares in another order), their FP8 rows and scales those of fp8_gemm.quantize_rows on the normed
    rows (the same arithmetic in two launches), and (compiled) within E4M3's rounding of the normed rows, saturated
    at 448."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=generator).to(dtype) * 3
    delta = torch.randn(tokens, hidden, device=device, generator=generator).to(dtype)
    weight = torch.randn(hidden, device=device, generator=generator).to(torch.float32 if gemma else dtype)
    static_scale = torch.tensor([0.004], device=device) if static else None  # values past 1.79 saturate

    def same_norm(got, plain):
        if device == "cpu":
            assert torch.equal(got, plain)
        else:
            torch.testing.assert_close(got, plain, rtol=2.0**-7, atol=0)

    normed, rows, scale = fused.rms_norm_fp8(x, weight, 1e-5, static_scale)
    same_norm(normed, fused.rms_norm(x, weight, 1e-5))
    outputs = [(normed, rows, scale)]
    h = x.clone()
    h_out, normed, rows, scale = fused.add_rms_norm_fp8(h, delta, weight, 1e-5, static_scale)
    plain_h, plain = fused.add_rms_norm(x.clone(), delta, weight, 1e-5)
    assert h_out is h and torch.equal(h, plain_h)
    same_norm(normed, plain)
    outputs.append((normed, rows, scale))
    for normed, rows, scale in outputs:
        expected_rows, expected_scale = fp8_gemm.quantize_rows(normed, static_scale)
        assert torch.equal(scale, expected_scale)
        assert torch.equal(rows.view(torch.uint8), expected_rows.view(torch.uint8))
        torch.testing.assert_close(scale, fp8.quantize_rows_ref(normed, static_scale)[1], rtol=1e-6, atol=0)
        if device == "cuda":  # the interpreter's conversion to E4M3 does not round to nearest (`representable`)
            target = torch.minimum(torch.maximum(normed.float(), -448 * scale), 448 * scale)  # saturated
            assert ((rows.float() * scale - target).abs() <= rounding_bound(target, scale)).all()
    if static:
        assert (rows.float().abs() == 448).any()


@needs_interpreter
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_norms_quantizing_their_rows_interpreted(static, gemma, kernels):
    check_norms_fp8(5, 96, torch.bfloat16, "cpu", static, gemma, seed=int(static) + 2 * int(gemma))


@needs_interpreter
def test_triton_ops_linear_takes_the_rows_its_input_kernel_quantized_interpreted(kernels, monkeypatch):
    """A norm told which FP8 weight reads its output quantizes the rows for it, and linear takes them for
    that weight and that tensor only, launching no quantization of its own; the product is the unfused path's to the
    bit. One row (the gemv, x in bf16) quantizes nothing."""
    from lorad.daemon.model import ops as ops_module

    generator = torch.Generator().manual_seed(12)
    quantized = fp8.quantize_weight(torch.randn(48, 64, generator=generator) * 0.1)
    weight = ops_module.Fp8Weight(quantized.weight, quantized.scale)  # the class ops.py dispatches on
    other = ops_module.Fp8Weight(quantized.weight.clone(), quantized.scale.clone())
    h = torch.randn(5, 64, generator=generator).bfloat16()
    delta = torch.randn(5, 64, generator=generator).bfloat16()
    norm_weight = torch.randn(64, generator=generator).bfloat16()
    ops = ops_module.TritonOps(torch.device("cpu"), 64, 16)
    unfused = ops.linear(fused.add_rms_norm(h.clone(), delta, norm_weight, 1e-5)[1], weight)
    _, x = ops.add_rms_norm(h.clone(), delta, norm_weight, 1e-5, feeds=weight)
    quantize_rows = fp8_gemm.quantize_rows
    monkeypatch.setattr(fp8_gemm, "quantize_rows", lambda *args: pytest.fail("quantized the rows again"))
    assert torch.equal(ops.linear(x, weight), unfused)
    monkeypatch.setattr(fp8_gemm, "quantize_rows", quantize_rows)
    _, x = ops.add_rms_norm(h.clone(), delta, norm_weight, 1e-5, feeds=weight)
    taken = []
    monkeypatch.setattr(fp8_gemm, "quantize_rows", lambda *args: taken.append(1) or quantize_rows(*args))
    assert torch.equal(ops.linear(x, other), unfused) and taken  # another weight: quantized by linear itself
    assert torch.equal(ops.linear(x.clone(), weight), unfused) and len(taken) == 2  # another tensor: likewise
    monkeypatch.setattr(fused, "rms_norm_fp8", lambda *args: pytest.fail("quantized a row the gemv reads"))
    one = ops.rms_norm(h[:1], norm_weight, 1e-5, feeds=weight)
    assert torch.equal(ops.linear(one, weight), ops.linear(fused.rms_norm(h[:1], norm_weight, 1e-5), weight))


def test_decode_batches_take_the_rows_kernel_up_to_64_rows_and_narrow_projections_up_to_128():
    from lorad.gpu_ops.fp8_gemm import takes_rows_kernel

    for rows in (2, 64):
        assert all(takes_rows_kernel(rows, out) for out in (4096, 3 * 4096, 2 * 11008))
    assert takes_rows_kernel(65, 4096) and takes_rows_kernel(128, 4096) and not takes_rows_kernel(129, 4096)
    assert not takes_rows_kernel(65, 4097) and not takes_rows_kernel(128, 3 * 4096)


@needs_interpreter
def test_fp8_linear_takes_the_rows_kernel_for_a_narrow_projection_past_64_rows_interpreted(kernels, monkeypatch):
    """100 rows by a 48-column projection: quantized per token and multiplied by the interpreted rows kernel, not
    torch._scaled_mm, within float32 accumulation of the same arithmetic."""
    gemm, _, _ = kernels
    generator = torch.Generator().manual_seed(9)
    weight = fp8.quantize_weight(torch.randn(48, 64, generator=generator) * 0.1)
    exponents = torch.randint(-6, 2, (100,), generator=generator)
    x = representable((100, 64), exponents, generator)  # the interpreter's conversion to FP8 then exact
    x[:, 5] = 448 * torch.exp2(exponents.float())  # each row's amax: its scale is its power of two
    x = x.bfloat16()
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: pytest.fail("took torch._scaled_mm"))
    got = gemm.fp8_linear(x, weight)
    assert got.shape == (100, 48) and got.dtype == torch.bfloat16
    assert relative_error(got, fp8.scaled_mm_ref(x.float(), weight).double()) < 1e-2


# ---------------------------------------------------------------------------------------------------
# GPU: torch._scaled_mm and the compiled kernels

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8.fp8_unavailable(torch.device("cuda")) is not None,
    reason="needs a GPU with FP8 (compute capability >= 8.9)",
)
LLAMA_7B_PROJECTIONS = {"qkv": (4096, 3 * 4096), "o": (4096, 4096), "gate_up": (4096, 2 * 11008), "down": (11008, 4096),
                        "down_tp2": (5504, 4096)}  # a rank's half of down at TP=2: K past the last 256-deep read


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 128, 129, 512])
@pytest.mark.parametrize("projection", list(LLAMA_7B_PROJECTIONS))
def test_fp8_linear_gpu_against_references(rows, projection, kernels):
    """fp8_linear (gemv for one row but q|k|v and gate|up on an H200, fp8_rows_gemm up to 64 and up to 128 for o
    and down, torch._scaled_mm with per-token scales for more) within float32 accumulation of the same arithmetic
    (scaled_mm_ref), and within FP8's tolerance of the dequantized reference (the CPU engine's path) and of the bf16
    product."""
    gemm, _, _ = kernels
    in_features, out_features = LLAMA_7B_PROJECTIONS[projection]
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).bfloat16()
    weight_bf16 = (torch.randn(out_features, in_features, device="cuda", generator=generator) * in_features**-0.5).bfloat16()
    weight = fp8.quantize_weight(weight_bf16)
    got = gemm.fp8_linear(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    dequantized = fp8.fp8_linear_ref(x.float(), weight).double()
    if not gemm.takes_gemv(rows, out_features, x.device):
        assert relative_error(got, fp8.scaled_mm_ref(x.float(), weight).double()) < 1e-2
        assert relative_error(got, dequantized) < 0.05
    else:  # the gemv keeps x in bf16: only the weight is rounded
        assert relative_error(got, dequantized) < 1e-2
    assert relative_error(got, (x.float() @ weight_bf16.float().t()).double()) < 0.06


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("tokens", [2, 64, 1152])
def test_norms_quantizing_their_rows_gpu(tokens, static, kernels):
    """The compiled norms with their rows quantized on the 7B and Gemma 2 9B shapes: the plain kernels' outputs to the
    bit, the FP8 rows and scales quantize_rows_ref's of them (the hardware rounds to nearest even, as torch does)."""
    check_norms_fp8(tokens, 4096, torch.bfloat16, "cuda", static, seed=tokens)
    check_norms_fp8(tokens, 3584, torch.bfloat16, "cuda", static, gemma=True, seed=tokens + 1)


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_linear_gpu_static_scale_bias_and_graph_capture(kernels):
    gemm, _, _ = kernels
    x = torch.randn(16, 512, device="cuda").bfloat16()
    weight = fp8.quantize_weight(torch.randn(256, 512, device="cuda") * 0.04)
    weight.input_scale = x.float().abs().amax().reshape(1) / 448
    bias = torch.randn(256, device="cuda").bfloat16()
    eager = gemm.fp8_linear(x, weight, bias)
    assert relative_error(eager, fp8.scaled_mm_ref(x.float(), weight, bias.float()).double()) < 1e-2
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.fp8_linear(x, weight, bias)  # warm outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = gemm.fp8_linear(x, weight, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("layout", [(32, 32, 128, 2), (32, 8, 128, 8)], ids=["llama7b", "llama3_8b"])
@pytest.mark.parametrize("batch", [1, 64])
def test_attention_fp8_pages_gpu(layout, batch, kernels):
    """The compiled decode and prefill kernels over FP8 pages (bf16 queries) against float64 attention over the
    stored values and the reference over the same pages; write_kv's FP8 bytes equal write_kv_ref's."""
    _, _, attention_kernels = kernels
    from test_paged_attention import gpu_shapes

    heads, kv_heads, head_dim, tokens_per_page = layout
    scales = torch.tensor([[0.02, 0.015]], device="cuda")
    shapes = gpu_shapes(batch, batch, 2048, prefill=2)
    case = fp8_case(heads, kv_heads, head_dim, tokens_per_page, shapes, torch.bfloat16, torch.device("cuda"), scales, layers=1)
    total = sum(query_len for _, query_len in shapes)
    q = torch.randn(total, heads, head_dim, device="cuda").bfloat16()
    got = attention_kernels.attention(q, case.kv_view, 0, case.batch, head_dim**-0.5, kv_scales=scales)
    assert relative_error(got, truth(case, q, 0, head_dim**-0.5)) < 2e-2
    assert relative_error(got, paged_attention_ref(q, case.kv_view, 0, case.batch, head_dim**-0.5, kv_scales=scales).double()) < 2e-2
    k = torch.randn(total, kv_heads, head_dim, device="cuda").bfloat16()
    v = torch.randn(total, kv_heads, head_dim, device="cuda").bfloat16()
    expected = case.kv_view.clone()
    write_kv_ref(expected, 0, k, v, case.batch, scales)
    attention_kernels.write_kv(case.kv_view, 0, k, v, case.batch, scales)
    assert torch.equal(case.kv_view.view(torch.uint8), expected.view(torch.uint8))
