"""Streamed adapter placement (AdapterTable.place_streamed): a native thread queues an adapter's pages layer
by layer while the MBGMM kernels that read it wait on the device for each layer. `pytest -m gpu`.

The copies are held back behind a sleeping kernel on their stream, so a kernel that did not wait would
read the pool's poison (NaN) or finish early: it must still be running while they are held, then give
the float64 truth of the streamed weights, eagerly and from a CUDA graph captured before the adapter
existed. A copy that never comes ends the wait after STREAM_TIMEOUT_NS with `stream_error` raised, not
a hang; a copy that fails releases the waiting kernels and says why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lorad.daemon.cuda_graphs import capture
from lorad.gpu_ops import cuda_ext, mbgmm, page_pool
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, PagePool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, LAYERS, RANK, ROWS = 4096, 4, 32, 96
SHAPES = [(HIDDEN, HIDDEN)] * 7
Q = 0
HOLD_S = 0.4
CYCLES_PER_S = 1.98e9  # the H100's top SM clock: torch.cuda._sleep counts cycles


def adapter(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {(layer, Q): (torch.randn(RANK, HIDDEN, generator=generator) / HIDDEN**0.5,
                         torch.randn(HIDDEN, RANK, generator=generator) / RANK**0.5)
            for layer in range(LAYERS)}


def truth(x: torch.Tensor, weights: dict, layer: int) -> torch.Tensor:
    a, b = weights[(layer, Q)]
    return (x.double().cpu() @ a.double().t()) @ b.double().t()


def hold_copies(monkeypatch, seconds: float) -> None:
    """Every streamed placement's copies queue behind a kernel that sleeps `seconds` on their stream."""
    submit = page_pool._Streamer.submit

    def held(self, load, staged, ids):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(seconds * CYCLES_PER_S))
        submit(self, load, staged, ids)

    monkeypatch.setattr(page_pool._Streamer, "submit", held)


@pytest.fixture
def table():
    assert cuda_ext.available(), cuda_ext.invocation_path()
    pool = PagePool(2 * LAYERS * RANK * 2 + 16, HIDDEN, torch.bfloat16, torch.device("cuda"))
    pool.pages.fill_(float("nan"))  # poison: a read of pages not yet copied gives NaN
    table = AdapterTable(pool, 2, LAYERS, SHAPES)
    table.enable_streaming()
    return table


def still_running(event: torch.cuda.Event, seconds: float = HOLD_S / 2) -> bool:
    time.sleep(seconds)
    return not event.query()


def rows_and_segments(table, row_slots):
    x = torch.randn(len(row_slots), HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(len(row_slots), HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, y, mbgmm.Segments.build(LoraBatch.build(row_slots, x.device), table)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_the_kernel_waits_for_the_streamed_layer(table, monkeypatch, pinned):
    hold_copies(monkeypatch, HOLD_S)
    weights = adapter(1)
    load = table.place_streamed(0, table.stage(weights, pin=pinned))
    load.publish()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    started = time.perf_counter()
    mbgmm.mbgmm(x, y, LAYERS - 1, Q, segments, table)
    done = torch.cuda.Event()
    done.record()
    assert still_running(done), "the kernel did not wait for the copy"
    load.join()
    torch.cuda.synchronize()
    assert time.perf_counter() - started >= HOLD_S * 0.9
    assert table.stream_error.item() == 0 and load.error is None and load.queued()
    assert table.ready[0].item() == LAYERS
    torch.testing.assert_close(y.double().cpu(), truth(x, weights, LAYERS - 1), atol=2e-2, rtol=2e-2)


def test_a_graph_captured_before_the_adapter_waits_for_it(table, monkeypatch):
    resident = adapter(2)
    assert table.place(1, resident)
    assert table.place(0, adapter(3))  # the slot's first owner, while the graph is captured
    half = ROWS // 2
    x, y, segments = rows_and_segments(table, [0] * half + [1] * half)
    torch.cuda.synchronize()
    graph, _, _ = capture(lambda: mbgmm.mbgmm(x, y, 1, Q, segments, table))
    table.evict(0)
    hold_copies(monkeypatch, HOLD_S)
    weights = adapter(4)
    load = table.place_streamed(0, table.stage(weights, pin=False))
    load.publish()
    y.zero_()
    graph.replay()
    done = torch.cuda.Event()
    done.record()
    assert still_running(done), "the graph's kernel did not wait for the copy"
    load.join()
    torch.cuda.synchronize()
    assert table.stream_error.item() == 0
    torch.testing.assert_close(y[:half].double().cpu(), truth(x[:half], weights, 1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y[half:].double().cpu(), truth(x[half:], resident, 1), atol=2e-2, rtol=2e-2)


def test_a_copy_that_never_comes_ends_the_wait_with_an_error(table, monkeypatch):
    monkeypatch.setattr(mbgmm, "STREAM_TIMEOUT_NS", 50_000_000)
    hold_copies(monkeypatch, 2.0)
    load = table.place_streamed(0, table.stage(adapter(5), pin=False))
    load.publish()
    x, y, segments = rows_and_segments(table, [0] * ROWS)
    mbgmm.mbgmm(x, y, 0, Q, segments, table)
    done = torch.cuda.Event()
    done.record()
    started = time.perf_counter()
    done.synchronize()
    assert time.perf_counter() - started < 1.0  # gave up after 50 ms, long before the copy
    assert table.stream_error.item() == 1
    load.join()
    torch.cuda.synchronize()
    assert table.ready[0].item() == LAYERS and load.error is None


def test_a_failed_copy_releases_the_kernels_and_says_why():
    """In a process of its own: a copy to address 0 fails in the runtime; the chain stops there, queues its
    release (here: a word set to 7) and keeps the CUDA error, and the process's CUDA context still works."""
    script = textwrap.dedent("""
        import torch
        from lorad.gpu_ops import cuda_ext
        word = torch.zeros(1, dtype=torch.int32, device="cuda")
        seven = torch.full((1,), 7, dtype=torch.int32).pin_memory()
        data = torch.ones(1024, dtype=torch.int32).pin_memory()
        target = torch.zeros(1024, dtype=torch.int32, device="cuda")
        stream = torch.cuda.Stream()
        ops = [(target.data_ptr(), data.data_ptr(), 4096), (0, data.data_ptr(), 4096), (target.data_ptr(), data.data_ptr(), 4096)]
        chain = cuda_ext.copy_chain(ops, [(word.data_ptr(), seven.data_ptr(), 4)], stream, torch.device("cuda"))
        chain.wait()
        torch.cuda.current_stream().wait_stream(stream)
        print("ERROR", chain.error)
        print("ISSUED", chain.issued())
        print("WORD", word.item(), "TARGET", int(target.sum()))
        print("AFTER", int((torch.arange(10, device="cuda") * 2).sum()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["ERROR"].startswith("copy 1 of 3: cuda"), lines
    assert lines["ISSUED"] == "1" and lines["WORD"] == "7 TARGET 1024" and lines["AFTER"] == "90"
