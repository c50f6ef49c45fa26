"""The CPU LoRA invocation ops (gpu_ops/cuda_ext.py, gpu_ops/csrc): the extension's build and import,
the python path on the CPU against real shared memory and a worker process, and (`pytest -m gpu`) the
fused kernels: copy + flags over the mapped exchange, a worker process answering through it with no
host sync in the launches, the add for every dtype and stride, and the timeout that reports instead
of hanging.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import shutil
import time

import numpy as np
import pytest
import torch

from lorad.gpu_ops import cuda_ext
from lorad.shm.exchange import DONE_SEQ, JOB_SEQ, STATUS_OK, Exchange, ExchangeConfig
from lorad.shm.segment import new_instance

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

fork = multiprocessing.get_context("fork")
spawn = multiprocessing.get_context("spawn")  # the GPU tests' parent has a CUDA context: never fork it
FLAG_STRIDE = 128  # bytes between two workers' job flags (or done flags) in the exchange


def job_flags(exchange: Exchange) -> np.ndarray:
    """The workers' job flags as one strided int64 view (what copy_and_signal raises)."""
    return _flag_view(exchange, exchange.layout.job_line(0) + JOB_SEQ * 8)


def done_flags(exchange: Exchange) -> np.ndarray:
    return _flag_view(exchange, exchange.layout.worker_line(0) + DONE_SEQ * 8)


def _flag_view(exchange: Exchange, offset: int) -> np.ndarray:
    workers = exchange.config.workers
    assert exchange.layout.job_line(1 % workers) - exchange.layout.job_line(0) in (0, FLAG_STRIDE)
    return np.ndarray((workers,), np.int64, buffer=exchange.segment.buffer, offset=offset, strides=(FLAG_STRIDE,))


def lora_worker(exchange_name: str, worker: int, a: np.ndarray, b_t: np.ndarray, rows: tuple, rounds: int, delay_s: float):
    """A stand-in CPU LoRA worker: for job seq 1..rounds, wait for the job flag, compute its rows of
    x @ A^T @ B^T from the exchange (float64, stored fp32), publish done. Plain numpy, no torch."""
    exchange = Exchange.attach(exchange_name)
    slot = exchange.slots[worker]
    slot.pid = os.getpid()
    start, end = rows
    in_features, out_features = a.shape[1], b_t.shape[1]
    try:
        for seq in range(1, rounds + 1):
            slot.job_flag.wait(seq, timeout_s=60)
            time.sleep(delay_s)  # a slow CPU: the GPU side must not need the host to wait for this
            x = exchange.input[start:end, :in_features].astype(np.float64)
            exchange.output[start:end, :out_features] = (x @ a.T.astype(np.float64)) @ b_t.astype(np.float64)
            slot.finish(seq, STATUS_OK)
    finally:
        del slot
        exchange.close()


def start_workers(context, exchange: Exchange, a, b_t, tokens: int, rounds: int, delay_s: float):
    workers = exchange.config.workers
    bounds = np.linspace(0, tokens, workers + 1).astype(int)
    processes = []
    for worker in range(workers):
        rows = (int(bounds[worker]), int(bounds[worker + 1]))
        process = context.Process(target=lora_worker, args=(exchange.name, worker, a, b_t, rows, rounds, delay_s), daemon=True)
        process.start()
        processes.append(process)
    deadline = time.monotonic() + 120
    for worker, process in enumerate(processes):
        while exchange.slots[worker].pid != process.pid:
            assert process.exitcode is None, f"worker {worker} exited with {process.exitcode}"
            assert time.monotonic() < deadline, "worker not ready"
            time.sleep(1e-3)
    return processes


def join(processes) -> None:
    for process in processes:
        process.join(30)
        assert process.exitcode == 0, f"worker exit code {process.exitcode}"


def lora_reference(x: torch.Tensor, a: np.ndarray, b_t: np.ndarray) -> torch.Tensor:
    return (x.double().cpu() @ torch.from_numpy(a).double().t() @ torch.from_numpy(b_t).double()).float()


# ---- build and import (CI) -----------------------------------------------------------------------------


def test_extension_is_built_where_a_cuda_compiler_exists():
    path = cuda_ext.invocation_path()
    if shutil.which("nvcc") or os.environ.get("CUDACXX"):
        assert cuda_ext.built(), f"nvcc is on PATH but the extension was not built: {path}"
    if path != "fused-cuda":
        assert path.startswith("python: ") and not cuda_ext.available()
        if cuda_ext.built():
            # Says what is missing (a device) and what was built (the runtime version).
            assert "device" in path and "CUDA runtime 1" in path, path
        else:
            assert "not built" in path and "nvcc" in path, path


@pytest.mark.skipif(not cuda_ext.built() or torch.cuda.is_available(), reason="needs the extension and no GPU")
def test_without_a_gpu_the_module_imports_and_calls_fail_cleanly():
    from lorad.gpu_ops import _lorad_cuda as ext

    assert ext.runtime_version() >= 12000
    with pytest.raises(RuntimeError, match="cuda"):
        ext.device_count()
    # Arguments are checked before CUDA is touched.
    with pytest.raises(ValueError, match="8-byte aligned"):
        ext.copy_and_signal(0, 0, 0, 3, 1, 0)
    with pytest.raises(ValueError, match="timeout"):
        ext.wait_and_add(0, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 8)
    assert ext.MAX_FLAG_SEQS == cuda_ext.MAX_FLAG_SEQS
    with pytest.raises(ValueError, match="one seq per flag"):
        ext.copy_and_signal(0, 0, 0, 8, 1, 0, 2, 8, [1, 2, 3])
    with pytest.raises(ValueError, match="at most 64"):
        ext.copy_and_signal(0, 0, 0, 8, 1, 0, 65, 8)
    with pytest.raises(RuntimeError, match="not usable here"):
        cuda_ext.register_host(np.zeros(16))
    with pytest.raises(ValueError, match="row_bytes must be positive"):
        ext.copy_rows(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="null pointer"):
        ext.copy_rows(0, 0, 0, 8, 0, 1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="null tail pointer"):
        ext.copy_rows(0, 8, 8, 8, 8, 0, 0, 8, 4, 0)


# ---- python path (CPU, CI) -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_python_copy_and_signal_writes_data_then_flags(dtype):
    config = ExchangeConfig(workers=3, max_tokens=16, hidden=96, max_out=64)
    with Exchange.create(new_instance(), config) as exchange:
        flags = job_flags(exchange)
        # A bf16 view of the exchange's input bytes: the op copies bytes, whatever the dtype.
        raw = torch.from_numpy(exchange.input.view(np.uint16) if dtype == torch.bfloat16 else exchange.input)
        dst = raw.view(dtype).view(-1)[: 10 * 96]
        for seq in (1, 2):
            src = torch.randn(10, 96).to(dtype)
            cuda_ext.copy_and_signal(dst, src, flags, seq)
            assert torch.equal(dst.view(10, 96), src)
            assert flags.tolist() == [seq] * 3
            assert [slot.job_flag.load() for slot in exchange.slots] == [seq] * 3
        with pytest.raises(ValueError):
            cuda_ext.copy_and_signal(dst, torch.randn(11, 96).to(dtype), flags, 3)
        with pytest.raises(ValueError):
            cuda_ext.copy_and_signal(dst, src, flags.astype(np.int32), 3)
        del raw, dst, flags


@pytest.mark.parametrize("context", [fork, spawn], ids=["fork", "spawn"])  # spawn: as the GPU tests start them
def test_python_round_trip_through_a_worker_process(context):
    tokens, hidden, out_features, rank, rounds = 24, 64, 48, 8, 3
    config = ExchangeConfig(workers=2, max_tokens=32, hidden=hidden, max_out=out_features)
    a = np.random.randn(rank, hidden).astype(np.float32) / 8
    b_t = np.random.randn(rank, out_features).astype(np.float32) / 8
    with Exchange.create(new_instance(), config) as exchange:
        processes = start_workers(context, exchange, a, b_t, tokens, rounds, delay_s=0.0)
        inputs = torch.from_numpy(exchange.input)[:tokens, :hidden]
        results = torch.from_numpy(exchange.output)[:tokens, :out_features]
        error = torch.zeros(1, dtype=torch.int64)
        for seq in range(1, rounds + 1):
            x = torch.randn(tokens, hidden)
            y = torch.randn(tokens, out_features).to(torch.bfloat16)
            base = y.clone()
            staged = torch.empty(tokens, config.in_stride)
            staged[:, :hidden] = x  # the exchange's rows are padded to 64 bytes
            cuda_ext.copy_and_signal(torch.from_numpy(exchange.input)[:tokens], staged, job_flags(exchange), seq)
            cuda_ext.wait_and_add(y, results, done_flags(exchange), seq, error, timeout_s=30)
            assert int(error) == 0
            torch.testing.assert_close(results, lora_reference(x, a, b_t), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(y, (base.float() + results).to(torch.bfloat16), rtol=0, atol=0)
        del inputs, results
        join(processes)


def test_python_wait_times_out_and_reports():
    with Exchange.create(new_instance(), ExchangeConfig(workers=2, max_tokens=4, hidden=16, max_out=16)) as exchange:
        out = torch.randn(4, 16)
        before = out.clone()
        error = torch.zeros(1, dtype=torch.int64)
        results = torch.from_numpy(exchange.output)[:4, :16]
        exchange.slots[0].done_flag.store(5)  # one worker done, the other never answers
        start = time.monotonic()
        cuda_ext.wait_and_add(out, results, done_flags(exchange), 5, error, timeout_s=0.05)
        assert time.monotonic() - start < 5
        assert int(error) == 5 and torch.equal(out, before)
        cuda_ext.wait_and_add(out, results, done_flags(exchange), 6, error, timeout_s=0.01)
        assert int(error) == 5  # the first failure is kept until the caller resets the word
        del results


def test_argument_checks():
    out, result, error = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(1, dtype=torch.int64)
    flags = np.zeros(1, np.int64)
    with pytest.raises(ValueError):
        cuda_ext.wait_and_add(out.int(), result, flags, 1, error)
    with pytest.raises(ValueError):
        cuda_ext.wait_and_add(out, result[:, :4], flags, 1, error)
    with pytest.raises(ValueError):
        cuda_ext.wait_and_add(out, result.double(), flags, 1, error)
    with pytest.raises(ValueError):
        cuda_ext.wait_and_add(out, result, flags, 1, error.int())
    with pytest.raises(ValueError):
        cuda_ext.copy_and_signal(out.t(), result, flags, 1)
    with pytest.raises(TypeError):
        cuda_ext.copy_and_signal(out, result, [0], 1)


def test_copy_rows_checks_its_runs_before_anything_is_queued():
    """The page runs' bounds, shapes and dtypes are refused by name; without a usable extension the call says why
    and the page pool says which path its copies take."""
    dst, src = torch.zeros(8, 4), torch.ones(6, 4)
    for runs, message in ((np.array([[0, 0, 7]]), "reaches past src"), (np.array([[0, 5, 4]]), "reaches past"),
                          (np.array([[0, 0, 0]]), "lengths > 0"), (np.array([[-1, 0, 1]]), ">= 0"),
                          (np.array([0, 0, 1]), r"\[R, 3\]")):
        with pytest.raises(ValueError, match=message):
            cuda_ext.copy_rows(dst, src, runs)
    with pytest.raises(ValueError, match="differ"):
        cuda_ext.copy_rows(dst, src.double(), np.array([[0, 0, 1]]))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        cuda_ext.copy_rows(dst.t(), src, np.array([[0, 0, 1]]))
    path = cuda_ext.rows_copy_path()
    if not cuda_ext.available():
        assert path.startswith("torch: ") and path.removeprefix("torch: ") in cuda_ext.invocation_path()
        with pytest.raises(RuntimeError, match="not usable here"):
            cuda_ext.copy_rows(dst, src, np.array([[0, 2, 6]]))
    else:
        assert path == "cuda-ext"


class _RecordingExtension:
    """Stands in for the compiled extension: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def copy_and_signal(self, *args):
        self.calls.append(("copy_and_signal", args))

    def wait_and_add(self, *args):
        self.calls.append(("wait_and_add", args))


def test_fused_launcher_passes_device_addresses_worked_out_once(monkeypatch):
    """FusedLauncher (the CPU LoRA's fused path) on the CPU with a recording stand-in for the extension: each
    host address becomes the mapping's device address plus its offset, flags keep their count and stride,
    and an address outside the registered region is refused before any launch."""
    ext = _RecordingExtension()
    monkeypatch.setattr(cuda_ext, "_ext", ext)
    monkeypatch.setattr(cuda_ext, "_require_extension", lambda: None)
    region = np.zeros(1 << 16, dtype=np.uint8)
    host = region.ctypes.data
    mapping = type("Mapping", (), {"host_address": host, "nbytes": region.nbytes, "device_address": 1 << 40})()
    error = torch.from_numpy(region[64:72]).view(torch.int64)
    launcher = cuda_ext.FusedLauncher(mapping, error)
    assert launcher.error == (1 << 40) + 64
    flags = launcher.flags(np.ndarray((3,), np.int64, region, 1024, (128,)))
    assert flags == ((1 << 40) + 1024, 3, 128)
    src = torch.arange(8, dtype=torch.float32)
    launcher.copy_and_signal(host + 4096, src, flags, 7, stream=11)
    empty = src[:0]
    launcher.copy_and_signal(host + 4096, empty, flags, 8, stream=11)  # a flag only: no destination
    out = torch.zeros(2, 4, dtype=torch.bfloat16)
    launcher.wait_and_add(out, host + 8192, 16, flags, 7, timeout_ns=5, stream=11, skip_if_error=True)
    launcher.copy_and_signal(host + 4096, src, flags, [3, 5, 4], stream=11)  # a seq per flag: the workers' own
    launcher.wait_and_add(out, host + 8192, 16, flags, [3, 5, 4], timeout_ns=5, stream=11)
    assert ext.calls == [
        ("copy_and_signal", ((1 << 40) + 4096, src.data_ptr(), 32, (1 << 40) + 1024, 7, 11, 3, 128)),
        ("copy_and_signal", (0, empty.data_ptr(), 0, (1 << 40) + 1024, 8, 11, 3, 128)),
        ("wait_and_add", (out.data_ptr(), (1 << 40) + 8192, 2, 4, 4, 16, cuda_ext._DTYPE_CODES[torch.bfloat16],
                          (1 << 40) + 1024, 7, 11, 5, (1 << 40) + 64, 3, 128, True)),
        ("copy_and_signal", ((1 << 40) + 4096, src.data_ptr(), 32, (1 << 40) + 1024, 3, 11, 3, 128, [3, 5, 4])),
        ("wait_and_add", (out.data_ptr(), (1 << 40) + 8192, 2, 4, 4, 16, cuda_ext._DTYPE_CODES[torch.bfloat16],
                          (1 << 40) + 1024, 3, 11, 5, (1 << 40) + 64, 3, 128, False, [3, 5, 4])),
    ]
    for bad in (lambda: launcher.copy_and_signal(host + region.nbytes - 16, src, flags, 9, stream=11),
                lambda: launcher.copy_and_signal(host - 64, src, flags, 9, stream=11),
                lambda: launcher.wait_and_add(out, host + region.nbytes - 64, 16, flags, 9, 5, 11),
                lambda: launcher.flags(np.zeros(2, np.int64))):  # flags outside the region
        with pytest.raises(ValueError, match="outside the registered region"):
            bad()
    assert len(ext.calls) == 5
    with pytest.raises(ValueError):
        cuda_ext.FusedLauncher(mapping, error.int())


# ---- fused kernels (GPU) -------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@pytest.fixture
def mapped_exchange():
    """(exchange, mapping): a 3-worker exchange whose whole segment is registered for the GPU."""
    if not cuda_ext.available():
        pytest.fail(f"the fused path is not usable: {cuda_ext.invocation_path()}")
    config = ExchangeConfig(workers=3, max_tokens=512, hidden=1024, max_out=1024)
    exchange = Exchange.create(new_instance(), config)
    mapping = cuda_ext.register_host(exchange.segment.buffer)
    try:
        yield exchange, mapping
    finally:
        torch.cuda.synchronize()
        mapping.close()
        exchange.close()


def wait_host(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


@gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "nbytes, src_offset, dst_offset",
    [(1 << 20, 0, 0), (12345, 0, 0), (1000, 8, 8), (1000, 4, 4), (999, 1, 3), (0, 0, 0), (3 << 19, 16, 48)],
)
def test_fused_copy_and_signal(mapped_exchange, nbytes, src_offset, dst_offset):
    exchange, _ = mapped_exchange
    region = torch.from_numpy(exchange.input.view(np.uint8).reshape(-1))
    region.fill_(0xAB)
    flags = job_flags(exchange)
    flags[:] = 0
    for seq in (1, 2):  # twice: the grid's block counter must be back at zero after a launch
        source = torch.randint(0, 256, (nbytes + src_offset,), dtype=torch.uint8, device="cuda")
        src = source[src_offset:]
        dst = region[dst_offset : dst_offset + nbytes]
        cuda_ext.fused_copy_and_signal(dst, src, flags, seq)
        # The host learns the data is there from the flags alone, without synchronising.
        assert wait_host(lambda: int(flags.min()) >= seq), f"flags {flags.tolist()} never reached {seq}"
        assert torch.equal(dst, src.cpu())
        assert (region[:dst_offset] == 0xAB).all() and (region[dst_offset + nbytes : dst_offset + nbytes + 64] == 0xAB).all()
        assert flags.tolist() == [seq] * 3
    del region, dst


@gpu
@pytest.mark.timeout(120)
def test_fused_round_trip_with_worker_processes_and_no_host_sync(mapped_exchange):
    exchange, _ = mapped_exchange
    tokens, hidden, out_features, rank, rounds, delay_s = 200, 1024, 768, 16, 3, 0.4
    a = (np.random.randn(rank, hidden) / 16).astype(np.float32)
    b_t = (np.random.randn(rank, out_features) / 4).astype(np.float32)
    weight = torch.randn(out_features, hidden, device="cuda", dtype=torch.bfloat16) / 32
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(rounds)]
    staged = torch.empty(tokens, exchange.config.in_stride, device="cuda")  # fp32, the exchange's padded rows
    inputs = torch.from_numpy(exchange.input)[:tokens]
    results = torch.from_numpy(exchange.output)[:tokens, :out_features]
    error = torch.zeros(1, dtype=torch.int64, device="cuda")
    # Warm-up outside the measured launches: cuBLAS, and every kernel of the loop loaded once (CUDA
    # loads kernels lazily, on first launch), with flags of its own so that no worker sees a job.
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        warm_flags = np.frombuffer(page, np.int64, count=1)
        with cuda_ext.register_host(page):
            y = xs[0] @ weight.t()
            staged[:, :hidden].copy_(xs[0])
            cuda_ext.copy_and_signal(inputs, staged, warm_flags, 1)
            cuda_ext.wait_and_add(y, results, warm_flags, 1, error, timeout_s=10)
            torch.cuda.synchronize()
        del warm_flags
    processes = start_workers(spawn, exchange, a, b_t, tokens, rounds, delay_s)
    torch.cuda.synchronize()
    outputs = []
    start = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seq in range(1, rounds + 1):
            x = xs[seq - 1]
            staged[:, :hidden].copy_(x)
            cuda_ext.copy_and_signal(inputs, staged, job_flags(exchange), seq)
            y = x @ weight.t()  # the base projection runs while the workers compute
            cuda_ext.wait_and_add(y, results, done_flags(exchange), seq, error, timeout_s=60)
            outputs.append(y)
        launch_s = time.perf_counter() - start
    finally:
        torch.cuda.set_sync_debug_mode(0)
    done = int(done_flags(exchange).min())
    # Every launch returned while the workers were still busy: the host never waited for them.
    assert done < rounds and launch_s < delay_s, f"launches took {launch_s:.3f} s, done flags at {done}"
    torch.cuda.synchronize()
    assert int(error) == 0
    for x, y in zip(xs, outputs):
        expected = x.float() @ weight.float().t() + lora_reference(x, a, b_t).cuda()
        relative = ((y.float() - expected).norm() / expected.norm()).item()
        assert relative < 1e-2, relative
    assert int(done_flags(exchange).min()) == rounds
    del inputs, results
    join(processes)


@gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [768, 383])  # 16-byte path; one column at a time
def test_fused_wait_and_add_dtypes_and_strides(mapped_exchange, dtype, cols):
    exchange, _ = mapped_exchange
    rows = 77
    fused_qkv = torch.randn(rows, 3 * cols, device="cuda").to(dtype)  # add into the middle third (a slice)
    before = fused_qkv.clone()
    out = fused_qkv[:, cols : 2 * cols]
    results = torch.from_numpy(exchange.output)[:rows, :cols]  # padded row stride
    results.copy_(torch.randn(rows, cols))
    flags = done_flags(exchange)
    flags[:] = 9  # the workers have already answered
    error = torch.zeros(1, dtype=torch.int64, device="cuda")
    cuda_ext.fused_wait_and_add(out, results, flags, 9, error, timeout_s=10)
    torch.cuda.synchronize()
    assert int(error) == 0
    expected = before.clone()
    expected[:, cols : 2 * cols] = (before[:, cols : 2 * cols].float() + results.cuda()).to(dtype)
    torch.testing.assert_close(fused_qkv, expected, rtol=0, atol=0)
    del results, out


@gpu
@pytest.mark.timeout(60)
def test_fused_wait_times_out_reports_and_recovers(mapped_exchange):
    exchange, _ = mapped_exchange
    out = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    before = out.clone()
    results = torch.from_numpy(exchange.output)[:64, :512]
    results.fill_(1.0)
    flags = done_flags(exchange)
    flags[:] = 3
    flags[1] = 2  # one worker never answers job 3
    with mmap.mmap(-1, mmap.PAGESIZE) as page:  # the error word in mapped host memory
        word = np.frombuffer(page, np.int64, count=1)
        with cuda_ext.register_host(page):
            error = torch.from_numpy(word)
            start = time.monotonic()
            cuda_ext.fused_wait_and_add(out, results, flags, 3, error, timeout_s=0.2)
            # The host reads the error word without a sync...
            assert wait_host(lambda: int(word[0]) != 0, timeout_s=20), "no error reported"
            assert int(word[0]) == 3 and 0.15 < time.monotonic() - start < 20
            torch.cuda.synchronize()  # ...and the stream is free again: nothing hangs
            assert torch.equal(out, before)
            # The next wait on the same stream works (the grid's shared state was reset).
            flags[1] = 3
            cuda_ext.fused_wait_and_add(out, results, flags, 3, error, timeout_s=10)
            torch.cuda.synchronize()
            assert torch.equal(out, (before.float() + 1.0).to(torch.bfloat16))
            assert int(word[0]) == 3  # kept until the caller resets it
            del error
        del word
    del results


@gpu
@pytest.mark.timeout(60)
def test_fused_launcher_per_flag_seqs(mapped_exchange):
    """One launch for several workers whose seqs differ (FusedLauncher with a seq per flag): the copy raises
    each job flag to its own seq; the wait adds once every done flag has reached its own, and a flag short of
    its seq times out reporting that seq."""
    exchange, mapping = mapped_exchange
    error = torch.zeros(1, dtype=torch.int64, device="cuda")
    launcher = cuda_ext.FusedLauncher(mapping, error)
    jobs, done = job_flags(exchange), done_flags(exchange)
    jobs[:], done[:] = 0, 0
    src = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    launcher.copy_and_signal(exchange.input_bytes.ctypes.data, src, launcher.flags(exchange.job_flags[:3]), [4, 9, 2], stream)
    torch.cuda.synchronize()
    assert jobs.tolist() == [4, 9, 2]
    staged = torch.from_numpy(exchange.input_bytes[: src.numel() * 2].copy()).view(torch.bfloat16).view(5, 1024)
    assert torch.equal(staged, src.cpu())
    results = torch.from_numpy(exchange.output)
    results[:5, :256] = 1.0
    out = torch.zeros(5, 256, device="cuda", dtype=torch.bfloat16)
    flags = launcher.flags(exchange.done_flags[:3])
    done[:] = [4, 9, 1]  # worker 2 has not answered job 2
    launcher.wait_and_add(out, exchange.output.ctypes.data, exchange.output.shape[1], flags, [4, 9, 2],
                          timeout_ns=int(0.2e9), stream=stream)
    torch.cuda.synchronize()
    assert int(error) == 2 and not out.any()
    error.zero_()
    done[2] = 2
    launcher.wait_and_add(out, exchange.output.ctypes.data, exchange.output.shape[1], flags, [4, 9, 2],
                          timeout_ns=int(10e9), stream=stream)
    torch.cuda.synchronize()
    assert int(error) == 0 and bool((out == 1).all())
    with pytest.raises(ValueError, match="one seq per flag"):
        launcher.copy_and_signal(exchange.input_bytes.ctypes.data, src, launcher.flags(exchange.job_flags[:3]), [1, 2], stream)
    del results


@gpu
def test_invocation_path_on_the_gpu_machine():
    assert cuda_ext.invocation_path() == "fused-cuda"


@gpu
@pytest.mark.parametrize("source", ["pinned", "pageable", "device"])
def test_copy_rows_copies_each_run_then_the_tail_on_the_current_stream(source):
    if not cuda_ext.available():
        pytest.fail(f"the extension is not usable: {cuda_ext.invocation_path()}")
    src = torch.randn(64, 1024, dtype=torch.bfloat16)
    src = {"pinned": src.pin_memory(), "pageable": src, "device": src.cuda()}[source]
    dst = torch.full((128, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    runs = np.array([[0, 100, 5], [5, 3, 1], [6, 40, 30], [36, 7, 28]])
    flag, word = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.tensor([7], dtype=torch.int32).pin_memory()
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        cuda_ext.copy_rows(dst, src, runs, tail=(flag, word))
    stream.synchronize()
    expected = torch.full((128, 1024), float("nan"), dtype=torch.bfloat16)
    for offset, first, length in runs:
        expected[first : first + length] = src[offset : offset + length].cpu()
    torch.testing.assert_close(dst.cpu(), expected, atol=0, rtol=0, equal_nan=True)
    assert flag.item() == 7

