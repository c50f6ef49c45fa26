"""The LoRA kernels (gpu_ops/bgmv.py, mbgmv.py, mbgmm.py) checked three ways, always on fresh random
inputs against a float64 product of the weights that were placed in the pool:

- the pure-torch references against apply_lora_ref and the float64 product (CPU, CI);
- the Triton kernels in Triton's CPU interpreter on small shapes (CPU, CI, when triton imports);
- the compiled kernels at Llama-7B sizes (`pytest -m gpu`), plus CUDA-graph capture and a sync check.

The pool is filled with NaN before the adapters are placed, so a read of any page a kernel should not
touch (a row past the rank, a chunk past the row) turns the result into NaN.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from triton_interpreter import needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.daemon.engine.decode_graphs import capture  # noqa: E402
from lorad.gpu_ops import bgmv, mbgmm, mbgmv  # noqa: E402
from lorad.gpu_ops.launch import pdl_unavailable  # noqa: E402
from lorad.gpu_ops.lora import LoraBatch, apply_lora_ref  # noqa: E402
from lorad.gpu_ops.page_pool import AdapterTable, PagePool  # noqa: E402

Q, K, V, O, GATE, UP, DOWN = range(7)
KERNELS = ("bgmv", "mbgmv", "mbgmm")
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}



@pytest.fixture(scope="module")
def kernels():
    """The three kernel modules, their kernels interpreted when there is no GPU."""
    interpreted(bgmv._bgmv_shrink_kernel, bgmv, mbgmv, mbgmm)
    return bgmv, mbgmv, mbgmm


# ---------------------------------------------------------------------------------------------------
# Fixtures: a pool with adapters of chosen ranks, and the float64 truth


def model_shapes(hidden: int, kv: int, intermediate: int) -> list[tuple[int, int]]:
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]


@dataclass
class Setup:
    table: AdapterTable
    weights: dict[int, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]]  # slot -> (A, B) fp32
    ranks: list[int]
    dtype: torch.dtype
    device: torch.device


def build_setup(page: int, shapes, ranks: list[int], dtype, device, layers: int = 2, skip=(), seed: int = 0, num_pages=None) -> Setup:
    """Slot i holds an adapter of rank ranks[i] on every (layer, proj) except those in `skip`
    ((slot, proj) pairs: projections that adapter does not target, rank 0 in the table)."""
    generator = torch.Generator().manual_seed(seed)
    chunks = [(-(-i // page), -(-o // page)) for i, o in shapes]
    need = 1 + sum(r * (ci + co) for r in ranks for ci, co in chunks) * layers
    pool = PagePool(num_pages or need + 8, page, dtype, device)
    pool.pages.fill_(float("nan"))  # poison: every page no adapter owns
    table = AdapterTable(pool, len(ranks), layers, shapes)
    weights = {}
    for slot, rank in enumerate(ranks):
        adapter = {}
        for layer in range(layers):
            for proj, (in_dim, out_dim) in enumerate(shapes):
                if (slot, proj) in skip:
                    continue
                a = torch.randn(rank, in_dim, generator=generator) / in_dim**0.5
                b = torch.randn(out_dim, rank, generator=generator) / rank**0.5
                adapter[(layer, proj)] = (a, b)
        assert table.place(slot, adapter)
        weights[slot] = adapter
    return Setup(table, weights, ranks, dtype, device)


def truth(setup: Setup, x: torch.Tensor, row_slots: list[int], layer: int, proj: int) -> torch.Tensor:
    """float64 [T, out]: the LoRA delta of every row from the weights as the pool holds them."""
    out_dim = setup.table.shapes[proj][1]
    delta = torch.zeros(x.shape[0], out_dim, dtype=torch.float64, device=x.device)
    for slot in set(row_slots):
        if slot < 0 or (layer, proj) not in setup.weights[slot]:
            continue
        a, b = setup.weights[slot][(layer, proj)]
        a = a.to(setup.dtype).double().to(x.device)
        b_t = b.t().to(setup.dtype).double().to(x.device)
        rows = torch.tensor([t for t, s in enumerate(row_slots) if s == slot], device=x.device)
        delta[rows] = (x[rows].double() @ a.t()) @ b_t
    return delta


def launch(name: str, modules, x, y, layer, proj, batch: LoraBatch, table, max_rank, segments, config=None) -> None:
    bgmv_module, mbgmv_module, mbgmm_module = modules
    if config is not None:
        assert name == "mbgmv", "a tile config is MBGMV's"
        mbgmv_module.mbgmv(x, y, layer, proj, batch.row_slot, table, max_rank, config=config)
    elif name == "bgmv":
        bgmv_module.bgmv(x, y, layer, proj, batch.row_slot, table, max_rank)
    elif name == "mbgmv":
        mbgmv_module.lora_decode(x, y, layer, proj, batch, table, max_rank=max_rank)
    elif name == "mbgmm":
        mbgmm_module.lora_prefill(x, y, layer, proj, batch, table, segments=segments)
    elif name == "bgmv_ref":
        bgmv_module.bgmv_ref(x, y, layer, proj, batch.row_slot, table, max_rank)
    elif name == "mbgmm_ref":
        mbgmm_module.mbgmm_ref(x, y, layer, proj, segments, table)
    elif name == "apply_lora_ref":
        apply_lora_ref(x, y, layer, proj, batch, table)
    else:
        raise AssertionError(name)


def check(name, modules, setup: Setup, row_slots: list[int], layer: int, proj: int, seed: int, tolerance=None, config=None) -> float:
    """Run one kernel on a fresh x and a y that is a column slice of a wider buffer; check the delta
    against the truth, and that base rows, rank-0 rows and the columns around y are untouched."""
    table, device, dtype = setup.table, setup.device, setup.dtype
    in_dim, out_dim = table.shapes[proj]
    generator = torch.Generator().manual_seed(seed)
    rows = len(row_slots)
    x = torch.randn(rows, in_dim, generator=generator).to(device, dtype)
    # y's own values are small next to the delta, so y's rounding does not hide the delta's error,
    # yet an overwrite instead of an add would show as a 10% error.
    fused = (0.1 * torch.randn(rows, out_dim + 24, generator=generator)).to(device, dtype)
    before = fused.clone()
    y = fused[:, 8 : 8 + out_dim]
    batch = LoraBatch.build(row_slots, device)
    max_rank = bgmv.batch_max_rank(batch, table)
    segments = mbgmm.Segments.build(batch, table)
    launch(name, modules, x, y, layer, proj, batch, table, max_rank, segments, config)
    if device.type == "cuda":
        torch.cuda.synchronize()
    expected = truth(setup, x, row_slots, layer, proj)
    delta = y.double() - before[:, 8 : 8 + out_dim].double()
    assert torch.isfinite(delta).all(), f"{name}: non-finite output (a read outside the adapter's pages?)"
    assert torch.equal(fused[:, :8], before[:, :8]) and torch.equal(fused[:, 8 + out_dim :], before[:, 8 + out_dim :]), f"{name}: wrote outside y"
    idle = [t for t, s in enumerate(row_slots) if s < 0 or (layer, proj) not in setup.weights[s]]
    assert torch.equal(fused[idle], before[idle]), f"{name}: touched a base-only or rank-0 row"
    scale = expected.norm().item()
    error = (delta - expected).norm().item() / max(scale, 1e-30)
    limit = tolerance if tolerance is not None else TOLERANCE[dtype]
    assert error <= limit, f"{name} layer={layer} proj={proj} rows={rows}: relative error {error:.2e} > {limit:.0e}"
    return error


def mixed_rows(slots: list[int], count: int, seed: int, base_every: int = 5) -> list[int]:
    """`count` row slots drawn from `slots`, every base_every-th row base-only (when count > 1)."""
    rng = np.random.default_rng(seed)
    row_slots = [int(s) for s in rng.choice(slots, size=count)]
    if count > 1:
        for t in range(0, count, base_every):
            row_slots[t] = -1
    return row_slots


# ---------------------------------------------------------------------------------------------------
# CPU: the references (always)

CPU_RANKS = [1, 8, 16, 64, 128, 256, 3, 40]
CPU_SHAPES = model_shapes(hidden=96, kv=24, intermediate=200)  # 200: three pages, the last one 8/96 used


@pytest.fixture(scope="module")
def cpu_setup():
    skip = {(2, Q), (5, DOWN)}  # adapters that do not target these projections
    return build_setup(96, CPU_SHAPES, CPU_RANKS, torch.float32, torch.device("cpu"), skip=skip)


@pytest.mark.parametrize("name", ["bgmv_ref", "mbgmm_ref", "apply_lora_ref"])
@pytest.mark.parametrize("proj", [Q, K, DOWN, UP])
def test_refs_match_truth(name, proj, cpu_setup):
    row_slots = mixed_rows(list(range(len(CPU_RANKS))), 23, seed=proj)
    check(name, (bgmv, mbgmv, mbgmm), cpu_setup, row_slots, layer=1, proj=proj, seed=proj, tolerance=1e-5)


def test_refs_agree_with_apply_lora_ref_bf16():
    setup = build_setup(64, model_shapes(64, 16, 80), [8, 33, 2], torch.bfloat16, torch.device("cpu"), skip={(1, K)})
    row_slots = [0, -1, 2, 1, 1, 0, -1, 2]
    for proj in (Q, K, DOWN):
        errors = {name: check(name, (bgmv, mbgmv, mbgmm), setup, row_slots, 0, proj, seed=proj) for name in ("apply_lora_ref", "bgmv_ref", "mbgmm_ref")}
        # The fp32 references are at least as close to the truth as the all-bf16 apply_lora_ref.
        assert errors["bgmv_ref"] <= errors["apply_lora_ref"] + 1e-3
        assert errors["mbgmm_ref"] <= errors["apply_lora_ref"] + 1e-3


def test_segments_build(cpu_setup):
    row_slots = [3, -1, 0, 3, 3, 0, -1, 7]
    batch = LoraBatch.build(row_slots, torch.device("cpu"))
    segments = mbgmm.Segments.build(batch, cpu_setup.table)
    assert segments.slots == [0, 3, 7] and segments.lengths == [2, 3, 1] and segments.max_len == 3
    assert segments.rows.dtype == torch.int32 and segments.rows.tolist() == [2, 5, 0, 3, 4, 7]
    assert segments.meta.tolist() == [[0, 3, 7], [0, 2, 5], [2, 3, 1]]
    assert segments.max_rank == max(CPU_RANKS[s] for s in (0, 3, 7))
    empty = mbgmm.Segments.build(LoraBatch.build([-1, -1], torch.device("cpu")), cpu_setup.table)
    assert empty.num_segments == 0 and empty.max_rank == 0 and empty.meta.shape == (3, 0)


def test_batch_max_rank_reads_the_host_mirror(cpu_setup):
    batch = LoraBatch.build([1, -1, 6], torch.device("cpu"))
    assert bgmv.batch_max_rank(batch, cpu_setup.table) == max(CPU_RANKS[1], CPU_RANKS[6])
    assert bgmv.batch_max_rank(LoraBatch.build([-1], torch.device("cpu")), cpu_setup.table) == 0


def test_page_block():
    assert bgmv.page_block(4096, 4096, 256) == (256, True)
    assert bgmv.page_block(4096, 1024, 256) == (256, True)
    assert bgmv.page_block(5120, 13824, 256) == (256, True)
    assert bgmv.page_block(96, 200, 256) == (32, True)  # 96 = 3 * 32: tiles of 32 never straddle
    assert bgmv.page_block(40, 100, 256) == (128, False)  # no power-of-two factor >= 16: per-element pages
    assert bgmv.page_block(4096, 8, 256) == (16, True)


def test_launchers_reject_bad_operands(cpu_setup):
    table = cpu_setup.table
    x = torch.randn(4, 96)
    y = torch.zeros(4, 96)
    row_slot = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="projection"):
        bgmv.check_operands(x, torch.zeros(4, 24), Q, table)
    with pytest.raises(ValueError, match="row_slot"):
        bgmv.check_operands(x, y, Q, table, row_slot.long())
    with pytest.raises(ValueError, match="page pool"):
        bgmv.check_operands(x.double(), y, Q, table)
    with pytest.raises(ValueError, match="workspace"):
        bgmv.workspace_view(torch.zeros(10), 2, 4, 8, x.device)
    assert bgmv.workspace_view(torch.zeros(bgmv.workspace_numel(4, 8)), 2, 4, 8, x.device).shape == (2, 4, 16)  # rows 16-aligned


def test_empty_batches_do_nothing(cpu_setup):
    x = torch.randn(3, 96)
    y = torch.randn(3, 96)
    before = y.clone()
    batch = LoraBatch.build([-1, -1, -1], torch.device("cpu"))
    segments = mbgmm.Segments.build(batch, cpu_setup.table)
    mbgmv.lora_decode(x, y, 0, Q, batch, cpu_setup.table, max_rank=0)
    mbgmm.lora_prefill(x, y, 0, Q, batch, cpu_setup.table, segments=segments)
    bgmv.bgmv(x, y, 0, Q, batch.row_slot, cpu_setup.table, 0)
    assert torch.equal(y, before)


# ---------------------------------------------------------------------------------------------------
# CPU: the Triton kernels in the interpreter (small shapes)

INTERPRETER_RANKS = [1, 8, 16, 64, 5, 24]


@pytest.fixture(scope="module")
def interpreter_setups():
    built = {}

    def get(page: int, dtype) -> Setup:
        if (page, dtype) not in built:
            # page 64: tiles aligned to pages; page 40: no power-of-two tile divides it (per-element pages).
            shapes = model_shapes(page, page // 4, 2 * page + page // 2)
            built[(page, dtype)] = build_setup(page, shapes, INTERPRETER_RANKS, dtype, torch.device("cpu"), skip={(4, K)})
        return built[(page, dtype)]

    return get


@needs_interpreter
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("rank_case", ["1", "8", "16", "64", "mixed"])
def test_kernels_interpreted_ranks(name, rank_case, kernels, interpreter_setups):
    setup = interpreter_setups(64, torch.bfloat16)
    slots = list(range(len(INTERPRETER_RANKS))) if rank_case == "mixed" else [INTERPRETER_RANKS.index(int(rank_case))]
    row_slots = mixed_rows(slots, 9, seed=len(rank_case))
    for proj in (Q, K, DOWN):
        check(name, kernels, setup, row_slots, layer=1, proj=proj, seed=proj)


@needs_interpreter
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kernels_interpreted_dtypes(name, dtype, kernels, interpreter_setups):
    setup = interpreter_setups(64, dtype)
    row_slots = mixed_rows(list(range(len(INTERPRETER_RANKS))), 7, seed=3)
    for proj in (UP, V):
        check(name, kernels, setup, row_slots, layer=0, proj=proj, seed=proj)


@needs_interpreter
@pytest.mark.parametrize("name", KERNELS)
def test_kernels_interpreted_unaligned_pages_and_single_row(name, kernels, interpreter_setups):
    setup = interpreter_setups(40, torch.bfloat16)
    for proj in (Q, K, DOWN, GATE):
        check(name, kernels, setup, mixed_rows(list(range(len(INTERPRETER_RANKS))), 6, seed=proj), 1, proj, seed=proj)
    check(name, kernels, setup, [3], 0, DOWN, seed=11)  # batch of one row
    check(name, kernels, setup, [4], 0, K, seed=12)  # one row whose adapter skips k_proj


@needs_interpreter
def test_kernels_interpreted_shrink_expand_split(kernels, interpreter_setups):
    """The split-K partials: shrink into a workspace with several splits, expand sums them."""
    _, mbgmv_module, _ = kernels
    setup = interpreter_setups(64, torch.float32)
    table = setup.table
    row_slots = [0, 3, -1, 5]
    batch = LoraBatch.build(row_slots, torch.device("cpu"))
    in_dim, out_dim = table.shapes[DOWN]
    x = torch.randn(4, in_dim)
    v = torch.full((4, 4, 64), float("nan"))
    mbgmv_module.mbgmv_shrink(x, v, 0, DOWN, batch.row_slot, table, 64)
    y = torch.zeros(4, out_dim) + 0.5
    mbgmv_module.mbgmv_expand(v, y, 0, DOWN, batch.row_slot, table, 64)
    expected = truth(setup, x, row_slots, 0, DOWN) + 0.5
    assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("width", [64, 256])
@pytest.mark.parametrize("n_per_program", [1, 2, 3])
def test_mbgmm_expand_tile_loop_interpreted(width, n_per_program, kernels, interpreter_setups):
    """MBGMM's expand over every grouping of up_proj's three output tiles (one, two and three a program,
    a last group short), summing two split partials, with the rank held whole at the workspace's width
    (256: a narrower output tile); rows of no segment untouched."""
    _, _, mbgmm_module = kernels
    setup = interpreter_setups(64, torch.float32)
    table = setup.table
    row_slots = [3, 0, -1, 3, 5, 1, 3, 2, 0]
    batch = LoraBatch.build(row_slots, torch.device("cpu"))
    segments = mbgmm_module.Segments.build(batch, table)
    in_dim, out_dim = table.shapes[UP]
    assert mbgmm_module.expand_tiles(width, out_dim, table.pool.page_elems)[1] * 2 < out_dim  # three tiles or more
    x = torch.randn(len(row_slots), in_dim)
    v = torch.full((2, len(row_slots), width), float("nan"))
    mbgmm_module.mbgmm_shrink(x, v, 0, UP, segments, table)
    y = torch.zeros(len(row_slots), out_dim) + 0.5
    mbgmm_module.mbgmm_expand(v, y, 0, UP, segments, table, n_per_program=n_per_program)
    expected = truth(setup, x, row_slots, 0, UP) + 0.5
    assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4)


def mbgmv_configs(module) -> list:
    """MBGMV tile configurations that take each branch: rank blocks smaller and larger than the ranks,
    several K tiles per shrink program, a rank loop in the expand, other warp counts."""
    config = module.DecodeConfig
    return [
        config(),
        config(shrink_r=16, block_k=32, expand_r=16, block_n=32),
        config(shrink_r=32, block_k=16, k_tiles=2, expand_r=32, block_n=16, num_warps=2, expand_warps=8),
        config(shrink_r=16, block_k=64, k_tiles=4, expand_r=16, block_n=64),
    ]


@needs_interpreter
@pytest.mark.parametrize("index", range(4))
def test_mbgmv_configs_interpreted(index, kernels, interpreter_setups):
    _, mbgmv_module, _ = kernels
    config = mbgmv_configs(mbgmv_module)[index]
    for page in (64, 40):
        setup = interpreter_setups(page, torch.bfloat16)
        for proj in (Q, K, DOWN):
            check("mbgmv", kernels, setup, mixed_rows(list(range(len(INTERPRETER_RANKS))), 7, seed=proj + index), 1, proj, seed=proj, config=config)


def test_decode_config_covers_shapes():
    """Every Llama-7B projection shape has a tuned config; unknown shapes get one too; tiles fit the
    workspace's MAX_SPLITS."""
    for shape in [(4096, 4096), (4096, 1024), (4096, 11008), (11008, 4096), (5120, 13824), (13824, 5120), (96, 24)]:
        for max_rank, pdl in itertools.product((1, 16, 64, 256), (False, True)):
            config = mbgmv.decode_config(*shape, max_rank, pdl)
            assert config.block_k & (config.block_k - 1) == 0 and config.block_n & (config.block_n - 1) == 0
            splits = mbgmv._shrink_plan(4096, shape[0], None, config)[0]
            assert 1 <= splits <= bgmv.MAX_SPLITS


def test_the_early_launch_takes_the_nearest_tuned_tiles():
    """Shapes the early launch's sweep did not cover take the tiles of the nearest swept shape, never the plain
    tiles' wide expand grid (Llama-3-8B's MLP is 14336 wide: with the plain tiles its decode step took 15%
    longer launched early than in stream order, BENCHMARKS.md)."""
    for table, max_rank in ((mbgmv.TUNED_PDL, 64), (mbgmv.TUNED_LOW_RANK_PDL, 16)):
        assert mbgmv.decode_config(4096, 14336, max_rank, True) == table[(4096, 11008)]  # Llama-3-8B gate, up
        assert mbgmv.decode_config(14336, 4096, max_rank, True) == table[(11008, 4096)]  # its down
        assert mbgmv.decode_config(5120, 5120, max_rank, True) == table[(4096, 4096)]  # a 13B's q, o
        assert mbgmv.decode_config(4096, 1024, max_rank, True) == table[(4096, 4096)]  # GQA k, v: as q in their group
    assert mbgmv.decode_config(4096, 14336, 64, False) == mbgmv.DecodeConfig()  # stream order: unchanged
    assert mbgmv.decode_config(4096, 4096, 256, True) == mbgmv.TUNED[(4096, 4096)]  # ranks past 64: the plain tiles


def test_mbgmm_launch_shapes(monkeypatch):
    """On an H100's 132 SMs: MBGMM's split-K over a 2048-token prompt as many as the workspace allows at
    rank 16 and fewer at wider ranks (at most SPLIT_PARTIALS partial values a row), all of them over a
    short prompt; the expand holds the whole rank and its programs cover every output tile exactly once."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(bgmv, "sm_count", lambda device, otherwise: 132)
    monkeypatch.setattr(mbgmm, "sm_count", lambda device, otherwise: 132)
    table = build_setup(64, [(4096, 4096)] * 7, [16, 64, 256], torch.bfloat16, cpu, layers=1).table

    def segments(slot: int, rows: int):
        return mbgmm.Segments.build(LoraBatch.build([slot] * rows, cpu), table)

    for slot, width, splits in ((0, 16, 16), (1, 64, 8), (2, 256, 2)):
        long_prompt, short_prompt = segments(slot, 2048), segments(slot, 40)
        assert mbgmm.mbgmm_splits(long_prompt, 4096, 4096, cpu) == splits
        assert mbgmm.mbgmm_splits(short_prompt, 4096, 4096, cpu) == bgmv.MAX_SPLITS
        block_r, block_n, aligned = mbgmm.expand_tiles(width, 4096, 4096)
        assert block_r >= width and aligned and block_r * block_n <= mbgmm.EXPAND_TILE_ELEMS
        tiles = 4096 // block_n
        for segs, per in ((long_prompt, 4 if width < 256 else 8), (short_prompt, 1)):
            assert mbgmm.expand_groups(segs, 64, tiles, cpu) == per


# ---------------------------------------------------------------------------------------------------
# GPU: the compiled kernels at Llama-7B sizes

GPU_RANKS = [1, 1, 8, 8, 16, 16, 64, 64, 128, 128, 256, 256, 3, 24, 40, 100, 255]
GPU_SHAPES = model_shapes(hidden=4096, kv=1024, intermediate=11000)  # 11000: last page 2808/4096 used
GPU_PROJECTIONS = (Q, K, UP, DOWN)


@pytest.fixture(scope="module")
def gpu_setups():
    built = {}

    def get(dtype) -> Setup:
        if dtype not in built:
            built.clear()  # one pool at a time
            torch.cuda.empty_cache()
            built[dtype] = build_setup(4096, GPU_SHAPES, GPU_RANKS, dtype, torch.device("cuda"), layers=1, skip={(13, K), (14, DOWN)})
        return built[dtype]

    return get


def gpu_rows(rank_case: str, count: int, seed: int) -> list[int]:
    if rank_case == "mixed":
        slots = list(range(len(GPU_RANKS)))
    else:
        slots = [slot for slot, rank in enumerate(GPU_RANKS[:12]) if rank == int(rank_case)]
    return mixed_rows(slots, count, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("rank_case", ["1", "8", "16", "64", "128", "256", "mixed"])
def test_kernels_gpu_bf16(name, rows, rank_case, kernels, gpu_setups):
    setup = gpu_setups(torch.bfloat16)
    for proj in GPU_PROJECTIONS:
        check(name, kernels, setup, gpu_rows(rank_case, rows, seed=proj + rows), 0, proj, seed=proj)


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kernels_gpu_dtypes(name, dtype, kernels, gpu_setups):
    setup = gpu_setups(dtype)
    for rows in (1, 64):
        for proj in GPU_PROJECTIONS:
            check(name, kernels, setup, gpu_rows("mixed", rows, seed=proj), 0, proj, seed=proj)


@pytest.mark.gpu
def test_kernels_gpu_match_refs_and_each_other(kernels, gpu_setups):
    """All kernels and references on one input: the same function."""
    setup = gpu_setups(torch.bfloat16)
    for name in (*KERNELS, "bgmv_ref", "mbgmm_ref", "apply_lora_ref"):
        check(name, kernels, setup, gpu_rows("mixed", 48, seed=5), 0, UP, seed=5, tolerance=2e-2 if name == "apply_lora_ref" else None)


@pytest.mark.gpu
def test_kernels_gpu_prefill_segments(kernels, gpu_setups):
    """Long segments (several BLOCK_M tiles each), rows interleaved across adapters."""
    setup = gpu_setups(torch.bfloat16)
    rng = np.random.default_rng(0)
    row_slots = [int(s) for s in rng.choice([0, 7, 11, 16, -1], size=700)]
    for name in ("mbgmm", "mbgmv"):
        for proj in GPU_PROJECTIONS:
            check(name, kernels, setup, row_slots, 0, proj, seed=proj)


@pytest.mark.gpu
def test_kernels_gpu_no_host_sync_and_graph_capture(kernels, gpu_setups):
    """The launch path never synchronises (sync debug mode raises on a sync) and can be captured
    into a CUDA graph whose replay gives the eager result."""
    setup = gpu_setups(torch.bfloat16)
    table = setup.table
    row_slots = gpu_rows("mixed", 64, seed=1)
    batch = LoraBatch.build(row_slots, torch.device("cuda"))
    max_rank = bgmv.batch_max_rank(batch, table)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    fused = torch.randn(64, 4096 + 2048, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(bgmv.workspace_numel(64, max_rank), device="cuda")

    def three_calls(out: torch.Tensor, segments) -> None:
        mbgmv.lora_decode(x, out[:, :4096], 0, Q, batch, table, max_rank=max_rank, workspace=workspace)
        mbgmm.lora_prefill(x, out[:, 4096:5120], 0, K, batch, table, segments=segments, workspace=workspace)
        bgmv.bgmv(x, out[:, 5120:], 0, V, batch.row_slot, table, max_rank, workspace)

    segments = mbgmm.Segments.build(batch, table)
    three_calls(fused.clone(), segments)  # compile first: compilation is no part of the launch path
    torch.cuda.synchronize()
    eager = fused.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        three_calls(eager, mbgmm.Segments.build(batch, table))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    captured = fused.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            three_calls(captured, segments)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def gpu_mbgmv_configs(module) -> list:
    """The tuned tiles of every shape, and the interpreter's configurations with GPU-sized tiles."""
    tuned = sorted(set(module.TUNED.values()) | set(module.TUNED_LOW_RANK_PDL.values()) | set(module.TUNED_PDL.values()), key=repr)
    return tuned + [dataclasses.replace(config, block_k=512, block_n=128) for config in mbgmv_configs(module)[1:]]


@pytest.mark.gpu
def test_mbgmv_configs_gpu(kernels, gpu_setups):
    """Every MBGMV tile configuration at 7B sizes (the default ones run in every other GPU test)."""
    _, mbgmv_module, _ = kernels
    setup = gpu_setups(torch.bfloat16)
    for index, config in enumerate(gpu_mbgmv_configs(mbgmv_module)):
        for proj in (Q, DOWN):  # 64 mixed rows: ranks 1..255 and base-only rows; DOWN's rows span 3 pages
            check("mbgmv", kernels, setup, gpu_rows("mixed", 64, seed=proj + index), 0, proj, seed=proj, config=config)


# ---------------------------------------------------------------------------------------------------
# MBGMV over a projection group (q, k, v or gate, up) in one launch pair


def check_group(module, setup: Setup, row_slots: list[int], layer: int, proj: int, members: int, seed: int, config=None,
                tile_list: bool = False):
    """mbgmv_group, or mbgmm_group when `module` is mbgmm (over the rows' segments, from a tile list as the prefill
    graphs launch it with tile_list), on the members' outputs side by side (a column slice of a wider buffer)
    against the float64 truth of each member; base rows and the columns around the group untouched."""
    table, device, dtype = setup.table, setup.device, setup.dtype
    generator = torch.Generator().manual_seed(seed)
    in_dim = table.shapes[proj][0]
    outs = [table.shapes[proj + m][1] for m in range(members)]
    x = torch.randn(len(row_slots), in_dim, generator=generator).to(dtype).to(device)
    wide = torch.randn(len(row_slots), sum(outs) + 8, generator=generator).to(dtype).to(device)
    before = wide.clone()
    y = wide[:, 3 : 3 + sum(outs)]
    max_rank = max(setup.ranks)
    if module is mbgmm:
        segments = mbgmm.Segments.build(LoraBatch.build(row_slots, device), table)
        if tile_list:
            segments = with_tile_list(segments, block_m=16)
        assert module.group_fits(table, proj, members)
        module.mbgmm_group(x, y, layer, proj, members, segments, table)
    else:
        config = module.group_fits(table, proj, members, max_rank, config)
        assert config is not None
        row_slot = torch.tensor(row_slots, dtype=torch.int32, device=device)
        module.mbgmv_group(x, y, layer, proj, members, row_slot, table, max_rank, config=config)
    expected = before[:, 3 : 3 + sum(outs)].double()
    expected += torch.cat([truth(setup, x, row_slots, layer, proj + m) for m in range(members)], dim=1)
    tolerance = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    assert (y.double() - expected).abs().max().item() <= tolerance
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + sum(outs) :], before[:, 3 + sum(outs) :])
    base = [t for t, s in enumerate(row_slots) if s < 0]
    assert torch.equal(wide[base], before[base])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mbgmv_group_interpreted(dtype, kernels, interpreter_setups):
    _, mbgmv_module, _ = kernels
    setup = interpreter_setups(64, dtype)
    row_slots = mixed_rows(list(range(len(INTERPRETER_RANKS))), 9, seed=11)  # slot 4 has no k_proj
    # q, k, v of a GQA shape (outputs 64, 16, 16): one column tile that fits them all
    narrow = mbgmv_module.DecodeConfig(block_k=64, block_n=16, expand_r=16)
    check_group(mbgmv_module, setup, row_slots, layer=1, proj=Q, members=3, seed=1, config=narrow)
    check_group(mbgmv_module, setup, row_slots, layer=0, proj=GATE, members=2, seed=2)
    # with the default tiles q (64 wide) and k (16) tile differently: no single launch
    assert mbgmv_module.group_fits(setup.table, Q, 3, max(setup.ranks)) is None


def with_tile_list(segments, block_m: int):
    """The segments with the list of their row tiles of block_m rows, as a prefill graph launches MBGMM over them."""
    tiles = [(segment, m0) for segment, length in enumerate(segments.lengths) for m0 in range(0, length, block_m)]
    device = segments.rows.device
    segments.tiles = torch.tensor(tiles, dtype=torch.int32, device=device).t().contiguous()
    segments.block_m = block_m
    return segments


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mbgmm_group_interpreted(dtype, kernels, interpreter_setups):
    """MBGMM over q, k, v of a GQA shape (outputs 64, 16, 16: the narrower members' programs past their columns return;
    slot 4 has no k_proj) and over gate, up, by segments and from a tile list, against each member's truth."""
    _, _, mbgmm_module = kernels
    setup = interpreter_setups(64, dtype)
    row_slots = mixed_rows(list(range(len(INTERPRETER_RANKS))), 40, seed=12)
    check_group(mbgmm_module, setup, row_slots, layer=1, proj=Q, members=3, seed=1)
    check_group(mbgmm_module, setup, row_slots, layer=0, proj=GATE, members=2, seed=2, tile_list=True)
    check_group(mbgmm_module, setup, row_slots, layer=0, proj=K, members=2, seed=3, tile_list=True)


def test_mbgmm_group_fits():
    """Members share one launch pair where they share the input: q, k, v (GQA's narrower k, v too) and gate, up."""
    pool = PagePool(64, 4096, torch.float32, torch.device("cpu"))
    llama3 = AdapterTable(pool, 2, 1, model_shapes(4096, 1024, 14336))
    assert mbgmm.group_fits(llama3, Q, 3) and mbgmm.group_fits(llama3, GATE, 2)
    assert not mbgmm.group_fits(llama3, UP, 2)  # up and down: inputs of 4096 and 14336
    assert not mbgmm.group_fits(llama3, DOWN, 2) and not mbgmm.group_fits(llama3, Q, 4)  # past the table; too many


@pytest.mark.gpu
def test_mbgmm_group_gpu(kernels, gpu_setups):
    _, _, mbgmm_module = kernels
    setup = gpu_setups(torch.bfloat16)
    for proj, members in ((Q, 3), (GATE, 2)):
        rows = gpu_rows("mixed", 64, seed=proj)
        rows = sorted(rows * 8)  # prompt rows: segments of several rows each
        check_group(mbgmm_module, setup, rows, 0, proj, members, seed=proj)
        check_group(mbgmm_module, setup, rows, 0, proj, members, seed=proj + 1, tile_list=True)


@pytest.mark.gpu
def test_mbgmv_group_gpu(kernels, gpu_setups):
    _, mbgmv_module, _ = kernels
    setup = gpu_setups(torch.bfloat16)
    for proj, members in ((Q, 3), (GATE, 2)):
        check_group(mbgmv_module, setup, gpu_rows("mixed", 64, seed=proj), 0, proj, members, seed=proj)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", ["mixed", "up-to-64", "low"])
def test_mbgmv_pdl_gpu(ranks, kernels, gpu_setups):
    """The expand launched early (programmatic dependent launch) behind the GEMM that writes y and the shrink,
    eagerly and replayed from a CUDA graph: each replay on fresh x gives exactly the plain stream order's result
    with the same tiles, for y and for the kernel after the expand that reads it (a race with the GEMM or the
    shrink would show as a difference). up-to-64 and low (ranks <= 16): the tiles decode_config gives with PDL."""
    _, mbgmv_module, _ = kernels
    reason = pdl_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    setup = gpu_setups(torch.bfloat16)
    table = setup.table
    if ranks != "mixed":
        max_rank = 16 if ranks == "low" else 64
        rows = mixed_rows([slot for slot, rank in enumerate(GPU_RANKS) if rank <= max_rank], 64, seed=4)
    else:
        max_rank, rows = max(setup.ranks), gpu_rows("mixed", 64, seed=4)
    row_slot = torch.tensor(rows, dtype=torch.int32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(4)

    def weight(out_dim, in_dim):
        return (torch.randn(out_dim, in_dim, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)

    shapes = table.shapes
    w_qkv = weight(sum(shapes[p][1] for p in (Q, K, V)), 4096)
    w_o = weight(shapes[O][1], 4096)
    w_gate_up = weight(shapes[GATE][1] + shapes[UP][1], 4096)
    x = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(bgmv.workspace_numel(64, max_rank), device="cuda")
    qkv_config = mbgmv_module.group_fits(table, Q, 3, max_rank, pdl=True)
    gate_config = mbgmv_module.group_fits(table, GATE, 2, max_rank, pdl=True)
    o_config = mbgmv_module.decode_config(*table.shapes[O], max_rank, True)
    assert qkv_config is not None and gate_config is not None
    if ranks != "mixed":
        assert o_config == (mbgmv_module.TUNED_LOW_RANK_PDL if ranks == "low" else mbgmv_module.TUNED_PDL)[(4096, 4096)]

    def outputs():
        return [torch.empty(64, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in (w_qkv, w_o, w_gate_up)] + [
            torch.empty(64, shapes[Q][1], device="cuda", dtype=torch.bfloat16)]

    def forward(outs, pdl):
        qkv, o, gate_up, after = outs
        torch.mm(x, w_qkv.t(), out=qkv)
        mbgmv_module.mbgmv_group(x, qkv, 0, Q, 3, row_slot, table, max_rank, workspace, config=qkv_config, pdl=pdl)
        torch.mul(qkv[:, : shapes[Q][1]], 2, out=after)  # reads the expand's y right after it
        torch.mm(x, w_o.t(), out=o)
        mbgmv_module.mbgmv(x, o, 0, O, row_slot, table, max_rank, workspace, config=o_config, pdl=pdl)
        torch.mm(x, w_gate_up.t(), out=gate_up)
        mbgmv_module.mbgmv_group(x, gate_up, 0, GATE, 2, row_slot, table, max_rank, workspace, config=gate_config, pdl=pdl)

    x.copy_(torch.randn(64, 4096, device="cuda", generator=generator))
    plain, early = outputs(), outputs()
    forward(plain, False)
    forward(early, True)
    torch.cuda.synchronize()
    for a, b in zip(plain, early):
        assert torch.equal(a, b)
    captured = outputs()
    graph, _, _ = capture(lambda: forward(captured, True), warmups=0)
    for _ in range(8):
        x.copy_(torch.randn(64, 4096, device="cuda", generator=generator))
        forward(plain, False)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(plain, captured):
            assert torch.equal(a, b)
