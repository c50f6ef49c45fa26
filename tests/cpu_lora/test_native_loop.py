"""The workers' native loop (cpu_lora/csrc/native_loop.cpp, cpu_lora/native_loop.py): its arithmetic
against torch, and a hot pool whose small jobs it serves giving the Python loop's results, handing
back what it must not serve (a changed store, a malformed job, a larger job), and staying alive."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from lorad.cpu_lora import native_loop
from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.exchange import IN_BFLOAT16, IN_FLOAT16, IN_FLOAT32, Job
from lorad.shm.segment import new_instance
from lorad.shm.store import AdapterStore

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

HIDDEN, MAX_OUT, MAX_TOKENS = 72, 48, 16
TORCH_DTYPES = {IN_FLOAT32: torch.float32, IN_FLOAT16: torch.float16, IN_BFLOAT16: torch.bfloat16}


def test_the_native_loop_is_built_and_agrees_with_the_exchange_layout():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the native loop is built on x86-64 only, this is {platform.machine()}")
    assert native_loop.worker_loop_path() == "native"


@pytest.mark.parametrize("rows,rank,in_features,out_features", [
    (1, 1, 64, 64), (3, 7, 100, 33), (8, 16, 96, 160), (2, 64, 17, 5), (5, 256, 40, 24)])
def test_native_arithmetic_matches_torch(rows, rank, in_features, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + rank)
    x_stride, out_stride = in_features + 3, out_features + 5  # padded rows: strides are honoured
    x = torch.randn(rows, x_stride, generator=generator)
    a = torch.randn(rank, in_features, generator=generator)
    b_t = torch.randn(rank, out_features, generator=generator)
    out = torch.full((rows, out_stride), 7.0)
    native_loop._native.NativeLoop.compute(x.data_ptr(), x_stride, a.data_ptr(), b_t.data_ptr(), out.data_ptr(),
                                           out_stride, rows, in_features, rank, out_features)
    expected = x[:, :in_features] @ a.t() @ b_t
    torch.testing.assert_close(out[:, :out_features], expected, rtol=1e-4, atol=1e-3)
    assert (out[:, out_features:] == 7.0).all()  # nothing written past the job's columns
    with pytest.raises(ValueError, match="rank"):
        native_loop._native.NativeLoop.compute(x.data_ptr(), x_stride, a.data_ptr(), b_t.data_ptr(), out.data_ptr(),
                                               out_stride, rows, in_features, 257, out_features)


def test_calibration_times_both_ways_and_finds_native_faster_for_tiny_jobs():
    max_work, timings = native_loop.calibrate(HIDDEN, MAX_OUT, MAX_TOKENS)
    assert list(timings) == [rows for rows in native_loop.CALIBRATION_ROWS if rows <= MAX_TOKENS][: len(timings)]
    assert all(native > 0 and reference > 0 for native, reference in timings.values())
    # At these widths a job is a few hundred flops: native is never slower than a torch dispatch.
    assert max_work >= native_loop.CALIBRATION_RANK


def adapter(name: str, seed: int, rank: int = 4) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seed)
    return SimpleNamespace(name=name, weights={
        (0, 0): (torch.randn(rank, HIDDEN, generator=generator), torch.randn(MAX_OUT, rank, generator=generator)),
        (1, 2): (torch.randn(2 * rank, HIDDEN, generator=generator), torch.randn(MAX_OUT - 16, 2 * rank, generator=generator)),
    })


@pytest.fixture
def hot_pool():
    """One worker, hot for the whole test, the native loop serving jobs up to 8 rows x rank 8."""
    instance = new_instance()
    with AdapterStore.create(instance, 1 << 20) as store:
        with WorkerPool(1, store, MAX_TOKENS, HIDDEN, MAX_OUT, instance=instance, job_timeout_s=5.0, stall_s=0.3,
                        native_max_work=64) as pool:
            pool.hot_polling = True  # one worker and this thread may share a core in CI: still correct
            pool.poll_hot_for(60)
            yield pool, store
            pool.stop_hot_polling()


def run_job(pool, adapter_id: int, weights, layer: int, proj: int, rows: int, dtype: int, seed: int) -> None:
    """One job through the pool, its result checked against torch (x in `dtype`, computed in fp32)."""
    a, b = weights[(layer, proj)]
    x = torch.randn(rows, a.shape[1], generator=torch.Generator().manual_seed(seed)).to(TORCH_DTYPES[dtype])
    raw = pool.exchange.input_rows(0, rows, a.shape[1], x.element_size())
    raw[:] = x.view(torch.uint8).reshape(rows, -1).numpy()
    seq = pool.submit(0, Job(adapter_id, layer, proj, 0, rows, a.shape[1], b.shape[0], dtype))
    assert pool.wait(0, seq)
    expected = x.float() @ a.t() @ b.t()
    torch.testing.assert_close(torch.from_numpy(pool.output[:rows, : b.shape[0]].copy()), expected, rtol=1e-4,
                               atol=1e-3)


def test_a_hot_pool_serves_small_jobs_natively_with_the_python_loops_results(hot_pool):
    pool, store = hot_pool
    first = adapter("first", 0)
    first_id = store.put(first)
    assert pool.worker_loop == "native"
    seed = 0
    for dtype in (IN_FLOAT32, IN_FLOAT16, IN_BFLOAT16):
        for rows in (1, 3, 8):
            seed += 1
            run_job(pool, first_id, first.weights, 0, 0, rows, dtype, seed)
    # The module's first job was the Python loop's (it teaches the native loop); the rest were native.
    assert pool.native_jobs == 8
    # Rank 8 (module (1, 2)): 8 rows x 8 is at the limit, 9 rows past it go back to Python.
    run_job(pool, first_id, first.weights, 1, 2, 8, IN_FLOAT32, 100)  # Python: first of its module
    run_job(pool, first_id, first.weights, 1, 2, 8, IN_FLOAT32, 101)  # native
    run_job(pool, first_id, first.weights, 1, 2, 9, IN_FLOAT32, 102)  # Python: 72 > 64
    assert pool.native_jobs == 9
    assert pool.restarts == 0


def test_a_changed_store_sends_jobs_back_to_python_and_new_weights_are_used(hot_pool):
    pool, store = hot_pool
    first = adapter("first", 0)
    first_id = store.put(first)
    run_job(pool, first_id, first.weights, 0, 0, 2, IN_FLOAT32, 1)
    run_job(pool, first_id, first.weights, 0, 0, 2, IN_FLOAT32, 2)
    assert pool.native_jobs == 1
    # Replacing "first" frees its block and publishes a new index (a new generation), whose id is new;
    # another adapter put now may take the old block: the native loop must not serve from what it knew.
    first_again = adapter("first", 5)
    first_again_id = store.put(first_again)
    other = adapter("other", 6)
    other_id = store.put(other)
    assert first_again_id != first_id
    # The next job names the replaced adapter's id, whose module the native loop still knows: it must
    # hand it back, and the Python loop fails it (KeyError), as it always did.
    pool.exchange.input[:2, :HIDDEN] = 0
    seq = pool.submit(0, Job(first_id, 0, 0, 0, 2, HIDDEN, MAX_OUT))
    assert not pool.wait(0, seq)
    run_job(pool, first_again_id, first_again.weights, 0, 0, 2, IN_FLOAT32, 3)
    run_job(pool, other_id, other.weights, 0, 0, 2, IN_FLOAT32, 4)
    assert pool.native_jobs == 1  # all three were the Python loop's (modules of a new generation)
    run_job(pool, first_again_id, first_again.weights, 0, 0, 2, IN_FLOAT32, 5)
    run_job(pool, other_id, other.weights, 0, 0, 2, IN_FLOAT32, 6)
    assert pool.native_jobs == 3 and pool.restarts == 0


def test_malformed_jobs_on_a_known_module_are_the_python_loops_to_fail(hot_pool):
    pool, store = hot_pool
    first = adapter("first", 0)
    first_id = store.put(first)
    run_job(pool, first_id, first.weights, 0, 0, 2, IN_FLOAT32, 1)
    bad = [Job(first_id, 0, 0, 0, 2, HIDDEN - 8, MAX_OUT),  # widths that disagree with the module
           Job(first_id, 0, 0, 0, 2, HIDDEN, MAX_OUT, in_dtype=9),  # an unknown dtype code
           Job(first_id, 0, 0, 4, 2, HIDDEN, MAX_OUT),  # rows backwards
           Job(first_id, 0, 0, 0, MAX_TOKENS + 1, HIDDEN, MAX_OUT)]  # rows past the exchange
    for job in bad:
        seq = pool.submit(0, job)
        assert not pool.wait(0, seq), job
    assert pool.native_jobs == 0
    run_job(pool, first_id, first.weights, 0, 0, 2, IN_FLOAT32, 2)  # the worker serves on, natively
    assert pool.native_jobs == 1 and pool.restarts == 0


def test_the_count_of_native_jobs_outlives_the_pool():
    instance = new_instance()
    with AdapterStore.create(instance, 1 << 20) as store:
        first = adapter("first", 0)
        first_id = store.put(first)
        with WorkerPool(1, store, MAX_TOKENS, HIDDEN, MAX_OUT, instance=instance, native_max_work=64) as pool:
            pool.hot_polling = True
            pool.poll_hot_for(60)
            for seed in range(3):
                run_job(pool, first_id, first.weights, 0, 0, 2, IN_FLOAT32, seed)
        assert pool.exchange is None and pool.native_jobs == 2  # read by /metrics after the engine closed


def test_a_hot_idle_native_loop_keeps_its_heartbeat(hot_pool):
    pool, _ = hot_pool
    deadline = time.monotonic() + 1.0  # more than three times stall_s
    beats = {pool.exchange.slots[0].heartbeat.load()}
    while time.monotonic() < deadline:
        assert pool.check() == 0
        beats.add(pool.exchange.slots[0].heartbeat.load())
        time.sleep(0.05)
    assert len(beats) > 5 and pool.restarts == 0


def test_a_native_loop_busy_for_longer_than_stall_s_is_not_taken_for_stalled(hot_pool):
    pool, store = hot_pool
    first = adapter("first", 0)
    first_id = store.put(first)
    run_job(pool, first_id, first.weights, 0, 0, 1, IN_FLOAT32, 1)  # taught: the rest are native
    pool.exchange.input[:1, :HIDDEN] = 1.0
    deadline, jobs = time.monotonic() + 1.0, 0  # more than three times stall_s, never idle for a millisecond
    while time.monotonic() < deadline:
        seq = pool.submit(0, Job(first_id, 0, 0, 0, 1, HIDDEN, MAX_OUT))
        assert pool.wait(0, seq)
        assert pool.check() == 0
        jobs += 1
    assert pool.native_jobs == jobs and pool.restarts == 0


def test_jobs_raised_together_mix_the_two_loops_in_order_and_every_result_is_right():
    """As the GPU raises them (cuda_ext.copy_and_signal): several jobs described ahead, then the job flag
    jumps to the last. Rounds mix jobs the native loop may serve with ones it must hand back (a new
    module, a larger job, a malformed one), and the store changes between some rounds."""
    rows_cap, rounds = 128, 40
    generator = torch.Generator().manual_seed(7)
    instance = new_instance()
    with AdapterStore.create(instance, 4 << 20) as store:
        adapters = {}
        for seed in range(2):
            weights = adapter(f"a{seed}", seed).weights
            adapters[store.put(SimpleNamespace(name=f"a{seed}", weights=weights))] = weights
        with WorkerPool(1, store, rows_cap, HIDDEN, MAX_OUT, instance=instance, native_max_work=64) as pool:
            pool.hot_polling = True
            pool.poll_hot_for(120)
            slot, served_by_python = pool.exchange.slots[0], 0
            for round_index in range(rounds):
                if round_index % 13 == 12:  # a new adapter: a new store generation
                    weights = adapter(f"b{round_index}", 100 + round_index).weights
                    adapters[store.put(SimpleNamespace(name=f"b{round_index}", weights=weights))] = weights
                jobs, next_row, next_byte = [], 0, 0
                input_bytes = pool.exchange.input_bytes.size
                for _ in range(int(torch.randint(1, 9, (1,), generator=generator))):
                    adapter_id = list(adapters)[int(torch.randint(len(adapters), (1,), generator=generator))]
                    layer, proj = ((0, 0), (1, 2))[int(torch.randint(2, (1,), generator=generator))]
                    a, b = adapters[adapter_id][(layer, proj)]
                    rows = int(torch.randint(1, 13, (1,), generator=generator))
                    dtype = (IN_FLOAT32, IN_FLOAT16, IN_BFLOAT16)[int(torch.randint(3, (1,), generator=generator))]
                    bad = bool(torch.rand(1, generator=generator) < 0.1)
                    x = torch.randn(rows, a.shape[1], generator=generator).to(TORCH_DTYPES[dtype])
                    # A job's compact input rows start at its first row times its own row bytes, and its output
                    # rows are its rows: lay the jobs out so that neither overlaps another job's.
                    row_bytes = a.shape[1] * x.element_size()
                    start = max(next_row, -(-next_byte // row_bytes))
                    if start + rows > rows_cap or (start + rows) * row_bytes > input_bytes:
                        break
                    pool.exchange.input_rows(start, start + rows, a.shape[1], x.element_size())[:] = (
                        x.view(torch.uint8).reshape(rows, -1).numpy())
                    job = Job(adapter_id, layer, proj, start, start + rows, a.shape[1] - (8 if bad else 0), b.shape[0],
                              dtype)
                    assert pool.enqueue(0, job) is not None
                    jobs.append((job, x, a, b, bad))
                    next_row, next_byte = start + rows, (start + rows) * row_bytes
                native_before = pool.native_jobs
                slot.job_flag.store(int(pool._seq[0]))  # the jump: every job of the round raised at once
                failed = pool.settle()
                assert failed == ([0] if any(bad for *_, bad in jobs) else []), round_index
                for job, x, a, b, bad in jobs:
                    if bad:
                        continue
                    got = torch.from_numpy(pool.output[job.row_start : job.row_end, : b.shape[0]].copy())
                    torch.testing.assert_close(got, x.float() @ a.t() @ b.t(), rtol=1e-4, atol=1e-3)
                served_by_python += len(jobs) - (pool.native_jobs - native_before)
                assert slot.done_flag.load() == int(pool._seq[0])  # every job served once, in order
            assert pool.native_jobs > 0 and served_by_python > 0 and pool.restarts == 0


def test_a_worker_logs_its_loop_to_the_engines_stderr():
    """A forkserver child inherits no logging handler: the pool passes the engine's level, so the worker's
    start-up line (which loop, and the measured limit) reaches the engine's log."""
    script = textwrap.dedent(f"""
        import logging
        from lorad.cpu_lora.worker import WorkerPool
        from lorad.shm.segment import new_instance
        from lorad.shm.store import AdapterStore

        if __name__ == "__main__":
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
            instance = new_instance()
            with AdapterStore.create(instance, 1 << 16) as store:
                with WorkerPool(1, store, {MAX_TOKENS}, {HIDDEN}, {MAX_OUT}, instance=instance):
                    pass
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "lorad.cpu_lora.native_loop worker_pid=" in line]
    assert lines and ("native_max_work=" in lines[0] or "loop=python" in lines[0]), done.stderr
