"""Streamed adapter placement (AdapterTable.place_streamed): the loader thread copies an adapter layer by
layer while the MBGMM kernels that read it wait on the device for each layer's pages. `pytest -m gpu`.

The loader is held back at a gate, so a kernel that did not wait would read the pool's poison (NaN) or
finish early; it must still be running while the gate is shut, then give the float64 truth of the
streamed weights, eagerly and from a CUDA graph captured before the adapter existed. A copy that
never comes ends the wait after STREAM_TIMEOUT_NS with `stream_error` raised, not a hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lorad.daemon.cuda_graphs import capture
from lorad.gpu_ops import mbgmm, page_pool
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, PagePool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, LAYERS, RANK, ROWS = 4096, 4, 32, 96
SHAPES = [(HIDDEN, HIDDEN)] * 7
Q = 0


def adapter(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {(layer, Q): (torch.randn(RANK, HIDDEN, generator=generator) / HIDDEN**0.5,
                         torch.randn(HIDDEN, RANK, generator=generator) / RANK**0.5)
            for layer in range(LAYERS)}


def truth(x: torch.Tensor, weights: dict, layer: int) -> torch.Tensor:
    a, b = weights[(layer, Q)]
    return (x.double().cpu() @ a.double().t()) @ b.double().t()


@pytest.fixture
def gate(monkeypatch):
    """The loader thread waits here before its first layer until the test opens it."""
    shut = threading.Event()
    bounds = page_pool._layer_bounds

    def gated(layout, total):
        if threading.current_thread().name == "lorad-adapter-stream":
            shut.wait(30)
        return bounds(layout, total)

    monkeypatch.setattr(page_pool, "_layer_bounds", gated)
    yield shut
    shut.set()


@pytest.fixture
def table():
    pool = PagePool(2 * LAYERS * RANK * 2 + 16, HIDDEN, torch.bfloat16, torch.device("cuda"))
    pool.pages.fill_(float("nan"))
    table = AdapterTable(pool, 2, LAYERS, SHAPES)
    table.enable_streaming()
    yield table
    table.close()


def still_running(event: torch.cuda.Event, seconds: float = 0.3) -> bool:
    time.sleep(seconds)
    return not event.query()


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_the_kernel_waits_for_the_streamed_layer(table, gate, pinned):
    weights = adapter(1)
    staged = table.stage(weights, pin=pinned)
    load = table.place_streamed(0, staged)
    load.publish()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    batch = LoraBatch.build([0] * ROWS, x.device)
    segments = mbgmm.Segments.build(batch, table)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    done = torch.cuda.Event()
    done.record()
    assert still_running(done), "the kernel did not wait for the copy"
    gate.set()
    load.join()
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0 and load.error is None
    assert table.ready[0].item() == LAYERS
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)


def test_a_graph_captured_before_the_adapter_waits_for_it(table, gate):
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    # slot 1: an adapter placed whole, rows half and half, so the graph reads both slots
    resident = adapter(2)
    assert table.place(1, resident)
    assert table.place(0, adapter(3))  # the slot's first owner, while the graph is captured
    row_slots = [0] * (ROWS // 2) + [1] * (ROWS // 2)
    segments = mbgmm.Segments.build(LoraBatch.build(row_slots, x.device), table)
    torch.cuda.synchronize()
    graph, _, _ = capture(lambda: mbgmm.mbgmm(x, y, 1, Q, segments, table))
    table.evict(0)
    weights = adapter(4)
    load = table.place_streamed(0, table.stage(weights, pin=False))
    load.publish()
    y.zero_()
    graph.replay()
    done = torch.cuda.Event()
    done.record()
    assert still_running(done), "the graph's kernel did not wait for the copy"
    gate.set()
    load.join()
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0
    half = ROWS // 2
    torch.testing.assert_close(y[:half].double().cpu(), truth(x[:half], weights, 1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y[half:].double().cpu(), truth(x[half:], resident, 1), atol=2e-2, rtol=2e-2)


def test_a_copy_that_never_comes_ends_the_wait_with_an_error(table, gate, monkeypatch):
    monkeypatch.setattr(mbgmm, "STREAM_TIMEOUT_NS", 50_000_000)
    load = table.place_streamed(0, table.stage(adapter(5), pin=False))
    load.publish()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    segments = mbgmm.Segments.build(LoraBatch.build([0] * ROWS, x.device), table)
    started = time.perf_counter()
    mbgmm.mbgmm(x, y, 0, Q, segments, table)
    torch.cuda.synchronize()
    assert time.perf_counter() - started < 10
    assert table.stream_error.item() == 1
    gate.set()
    load.join()
    torch.cuda.synchronize()
    assert table.ready[0].item() == LAYERS and load.error is None


def test_a_failed_copy_releases_the_kernels_and_says_why(table, monkeypatch):
    def broken(ids):
        raise RuntimeError("lost")

    monkeypatch.setattr(page_pool, "_runs", broken)
    load = table.place_streamed(0, table.stage(adapter(6), pin=False))
    load.publish()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    segments = mbgmm.Segments.build(LoraBatch.build([0] * ROWS, x.device), table)
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    load.join()
    torch.cuda.synchronize()
    assert "lost" in load.error and table.ready[0].item() == LAYERS and table.stream_error.item() == 0
