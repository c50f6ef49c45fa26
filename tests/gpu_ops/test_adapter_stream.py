"""Streamed adapter placement (AdapterTable.place_streamed): a kernel that reads a streamed slot is launched
before the adapter's pages are sent, and waits on the device for each layer. `pytest -m gpu`.

The pages are issued only after the kernel has been launched and seen still running (the engine never does
this: it queues them first, DESIGN.md says why; here it shows the wait), so a kernel that did
not wait would have read the pool's poison (NaN) or finished early; it must give the float64 truth of the
streamed weights, eagerly and from a CUDA graph captured before the adapter existed, from pinned and from
pageable host memory. A copy that never comes ends the wait after STREAM_TIMEOUT_NS with `stream_error`
raised, not a hang; a copy that fails to be queued releases the waiting kernels and says why."""

from __future__ import annotations

import time

import pytest
import torch

import triton_interpreter  # noqa: F401  (before the kernel modules: sets TRITON_INTERPRET without a GPU)

from lorad.daemon.engine.decode_graphs import capture  # noqa: E402
from lorad.gpu_ops import mbgmm, page_pool  # noqa: E402
from lorad.gpu_ops.lora import LoraBatch  # noqa: E402
from lorad.gpu_ops.page_pool import AdapterTable, PagePool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, LAYERS, RANK, ROWS = 4096, 4, 32, 96
SHAPES = [(HIDDEN, HIDDEN)] * 7
Q = 0
WAIT_S = 0.2


def adapter(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {(layer, Q): (torch.randn(RANK, HIDDEN, generator=generator) / HIDDEN**0.5,
                         torch.randn(HIDDEN, RANK, generator=generator) / RANK**0.5)
            for layer in range(LAYERS)}


def truth(x: torch.Tensor, weights: dict, layer: int) -> torch.Tensor:
    a, b = weights[(layer, Q)]
    return (x.double().cpu() @ a.double().t()) @ b.double().t()


@pytest.fixture
def table():
    pool = PagePool(2 * LAYERS * RANK * 2 + 16, HIDDEN, torch.bfloat16, torch.device("cuda"))
    pool.pages.fill_(float("nan"))  # poison: a read of pages not yet copied gives NaN
    table = AdapterTable(pool, 2, LAYERS, SHAPES)
    table.enable_streaming()
    return table


def still_running(seconds: float = WAIT_S) -> bool:
    """Whether the work queued on the current stream so far is still running `seconds` from now."""
    event = torch.cuda.Event()
    event.record()
    time.sleep(seconds)
    return not event.query()


def rows_and_segments(table, row_slots):
    x = torch.randn(len(row_slots), HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(len(row_slots), HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, y, mbgmm.Segments.build(LoraBatch.build(row_slots, x.device), table)


def load_kernels(table) -> None:
    """Both MBGMM kernels compiled and loaded, over a slot placed whole: a kernel's first launch loads its
    module, which synchronises the context, and the expand's would wait for the spinning shrink before
    the test could issue the pages (a lazy-loading deadlock that only the wait's timeout would end)."""
    assert table.place(1, adapter(0))
    x, y, segments = rows_and_segments(table, [1] * ROWS)
    mbgmm.mbgmm(x, y, 0, Q, segments, table)
    torch.cuda.synchronize()
    table.evict(1)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_the_kernel_waits_for_the_streamed_layer(table, pinned):
    load_kernels(table)
    weights = adapter(1)
    load = table.place_streamed(0, table.stage(weights, pin=pinned))
    load.make_current_stream_wait()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    assert still_running(), "the kernel did not wait for the copy"
    load.issue()
    load.join()
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0 and load.error is None
    assert table.ready[0].item() == LAYERS
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)


def test_a_graph_captured_before_the_adapter_waits_for_it(table):
    resident = adapter(2)
    assert table.place(1, resident)
    assert table.place(0, adapter(3))  # the slot's first owner, while the graph is captured
    half = ROWS // 2
    x, y, segments = rows_and_segments(table, [0] * half + [1] * half)
    torch.cuda.synchronize()
    graph, _, _ = capture(lambda: mbgmm.mbgmm(x, y, 1, Q, segments, table))
    table.evict(0)
    weights = adapter(4)
    load = table.place_streamed(0, table.stage(weights, pin=False))
    load.make_current_stream_wait()
    y.zero_()
    graph.replay()
    assert still_running(), "the graph's kernel did not wait for the copy"
    load.issue()
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0
    torch.testing.assert_close(y[:half].double().cpu(), truth(x[:half], weights, 1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y[half:].double().cpu(), truth(x[half:], resident, 1), atol=2e-2, rtol=2e-2)


def test_a_copy_that_never_comes_ends_the_wait_with_an_error(table, monkeypatch):
    monkeypatch.setattr(mbgmm, "STREAM_TIMEOUT_NS", 50_000_000)
    load_kernels(table)
    load = table.place_streamed(0, table.stage(adapter(5), pin=False))
    load.make_current_stream_wait()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    started = time.perf_counter()
    mbgmm.mbgmm(x, y, 0, Q, segments, table)
    torch.cuda.synchronize()
    assert time.perf_counter() - started < 2  # gave up after 50 ms
    assert table.stream_error.item() == 1
    load.join()
    torch.cuda.synchronize()
    assert table.ready[0].item() == LAYERS and load.error is None


def test_a_copy_that_cannot_be_queued_releases_the_kernels_and_says_why(table, monkeypatch):
    def broken(ids):
        raise RuntimeError("lost")

    load_kernels(table)
    load = table.place_streamed(0, table.stage(adapter(6), pin=False))
    load.make_current_stream_wait()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    monkeypatch.setattr(page_pool, "_run_array", broken)
    load.issue()
    torch.cuda.synchronize()
    assert "lost" in load.error and table.ready[0].item() == LAYERS and table.stream_error.item() == 0


def layers_then_stop(count: int):
    """An `until` for issue_streamed that lets `count` layers through, then says stop."""
    asked = []

    def until() -> bool:
        asked.append(True)
        return len(asked) > count

    return until


def test_a_copy_queued_in_parts_gives_the_truth(table):
    load_kernels(table)
    weights = adapter(7)
    load = table.place_streamed(0, table.stage(weights, pin=False))
    assert not page_pool.issue_streamed([load], until=layers_then_stop(2))  # ahead of the forward
    assert load.layers_left == LAYERS - 2 and not load.issued
    torch.cuda.synchronize()
    assert table.ready[0].item() == 2
    load.make_current_stream_wait()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    assert still_running(), "the kernel did not wait for the layers not yet queued"
    assert page_pool.issue_streamed([load])  # the rest, after the launch
    torch.cuda.synchronize()
    assert load.issued and load.error is None and table.stream_error.item() == 0
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)


def test_an_abandoned_copy_frees_its_slot_for_a_placement_that_does_not_stream(table):
    load_kernels(table)
    load = table.place_streamed(0, table.stage(adapter(8), pin=False))
    page_pool.issue_streamed([load], until=layers_then_stop(1))
    load.abandon()
    torch.cuda.synchronize()
    assert load.issued and load.error == "abandoned" and table.ready[0].item() == LAYERS
    table.evict(0)
    weights = adapter(9)
    assert table.place(0, weights)  # whole: its kernels do not wait, and must not find the old ready
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", ["cuda-ext", "torch"])
def test_layers_in_many_runs_of_pages_give_the_truth_by_either_copy_path(table, path):
    """A pool whose free pages are every other one (the KV cache's churn, at its worst): each streamed layer is 64
    runs of one page, queued from C++ in one call a layer (the default where the extension is usable) or by one
    torch copy a run, and the kernel still gives the truth."""
    load_kernels(table)
    if path == "cuda-ext":
        assert table.copy_path == "cuda-ext", table.copy_path
    else:
        table.copy_path = "torch: chosen by the test"
    pool = table.pool
    taken = pool.alloc(pool.num_free, "kv")
    pool.free(taken[::2], "kv")
    weights = adapter(10)
    load = table.place_streamed(0, table.stage(weights, pin=path == "torch"))
    assert len(page_pool._run_array(load.ids)) == len(load.ids)  # no two pages side by side
    load.issue()
    load.make_current_stream_wait()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    torch.cuda.synchronize()
    assert load.error is None and table.stream_error.item() == 0 and table.ready[0].item() == LAYERS
    assert table.streamed_runs == {"layers": LAYERS, "runs": len(load.ids)}
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)

