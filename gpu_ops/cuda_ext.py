"""Sync-free CPU LoRA invocation (CaraServe §4.2): hand a layer's activations to the CPU workers and take
their result back without the host ever waiting on the GPU.

Two paths with one interface:
- fused-cuda (lorad.gpu_ops._lorad_cuda, built from gpu_ops/csrc when a CUDA compiler exists):
  `copy_and_signal` is ONE kernel queued on the compute stream that copies device activations into the
  shared-memory exchange (registered as mapped pinned memory) and then raises the workers' job flags;
  `wait_and_add` is one kernel that waits on the GPU for the workers' done flags and adds their fp32
  result into the projection output. Both return at once; stream order does the rest.
- python: torch copies and host-side flag stores. On the CPU engine this is simply the path; with CUDA
  tensors it is CaraServe's "native" baseline (async copy, stream synchronize, flag store; host wait,
  copy back, add), kept for the benchmark and as the fallback where the extension is missing.

Flags are int64 sequence numbers in shared memory (shm/flags.py): a 1-D int64 numpy array or CPU tensor
view over them, several flags (one per worker) at any stride that is a multiple of 8 bytes.
`invocation_path()` says which path `copy_and_signal` / `wait_and_add` take for CUDA tensors.

The same extension queues an adapter's page runs (`copy_rows`): one driver call per run from C++, where a
torch copy per run costs the host several microseconds of Python and dispatch (`rows_copy_path()` says which).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import time

import numpy as np
import torch

log = logging.getLogger(__name__)

try:
    from lorad.gpu_ops import _lorad_cuda as _ext

    _IMPORT_ERROR: BaseException | None = None
except ImportError as error:  # built without a CUDA compiler: the python path only
    _ext = None
    _IMPORT_ERROR = error

DEFAULT_TIMEOUT_S = 5.0  # a job that takes longer has a dead or stalled worker (cf. WorkerPool.job_timeout_s)
FLAG_BYTES = 8
MAX_FLAG_SEQS = 64  # the most flags one launch with per-flag seqs carries (the extension's kMaxFlagSeqs)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# ---- which path ---------------------------------------------------------------------------------------


def built() -> bool:
    """True when the compiled extension imported (it imports without a GPU: CUDA errors come only
    from calls)."""
    return _ext is not None


@functools.cache
def invocation_path() -> str:
    """"fused-cuda", or "python: <why the fused path cannot be used here>"."""
    if _ext is None:
        return (
            f"python: the CUDA extension lorad.gpu_ops._lorad_cuda is not built ({_IMPORT_ERROR}); "
            "reinstall lorad (`pip install -e .`) with a CUDA compiler (nvcc) on PATH"
        )
    runtime = _ext.runtime_version()
    built_for = f"extension built for CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}"
    try:
        devices = _ext.device_count()
        runtime_view = f"its runtime sees {devices} device(s)"
    except RuntimeError as error:
        devices, runtime_view = 0, f"its runtime says: {error}"
    if not torch.cuda.is_available():
        return (
            f"python: no CUDA device for torch (torch {torch.__version__}, CUDA {torch.version.cuda}); "
            f"{built_for}, {runtime_view}"
        )
    if devices == 0:
        return f"python: torch sees {torch.cuda.device_count()} CUDA device(s) but {built_for} and {runtime_view}"
    return "fused-cuda"


def available() -> bool:
    """True when `copy_and_signal` / `wait_and_add` on CUDA tensors take the fused kernels."""
    return invocation_path() == "fused-cuda"


def _require_extension() -> None:
    if not available():
        raise RuntimeError(f"the fused CUDA path is not usable here: {invocation_path()}")


# ---- host memory the GPU can write ---------------------------------------------------------------------


class HostMapping:
    """A host region (the mmap of a shm Segment, a numpy array, a contiguous CPU tensor) pinned and
    mapped into the GPU's address space (cudaHostRegister, portable | mapped).

    While it is open, any tensor, array or flag inside the region can be passed to the fused ops. Close
    it (or leave the `with` block) before the region is unmapped; registering pins the pages, so
    register whole segments once at start-up, never per step. `cudaHostRegister` is slow (milliseconds)
    and may synchronise the device.
    """

    def __init__(self, region):
        _require_extension()
        self.host_address, self.nbytes = _region_address(region)
        if self.nbytes == 0:
            raise ValueError("register_host: the region is empty (CUDA rejects a zero-byte registration)")
        _ext.register_host(self.host_address, self.nbytes)
        self.device_address = _ext.device_pointer(self.host_address)
        self._region = region  # keep it alive while registered (an mmap is not pinned open by this)
        with _mappings_lock:
            _mappings.append(self)

    def device_address_of(self, host_address: int, nbytes: int = 0) -> int | None:
        offset = host_address - self.host_address
        if 0 <= offset and offset + nbytes <= self.nbytes:
            return self.device_address + offset
        return None

    def close(self) -> None:
        if self._region is None:
            return
        with _mappings_lock:
            _mappings.remove(self)
        self._region = None
        _ext.unregister_host(self.host_address)

    def __enter__(self) -> "HostMapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostMapping(host=0x{self.host_address:x}, device=0x{self.device_address:x}, nbytes={self.nbytes})"


_mappings: list[HostMapping] = []
_mappings_lock = threading.Lock()


def register_host(region) -> HostMapping:
    """Pin and map `region` for the GPU; see HostMapping."""
    return HostMapping(region)


def _region_address(region) -> tuple[int, int]:
    if isinstance(region, torch.Tensor):
        if region.is_cuda or not region.is_contiguous():
            raise ValueError("register_host takes a contiguous CPU tensor")
        return region.data_ptr(), region.numel() * region.element_size()
    if isinstance(region, np.ndarray):
        if not region.flags.c_contiguous:
            raise ValueError("register_host takes a C-contiguous array")
        return region.ctypes.data, region.nbytes
    if isinstance(region, (mmap.mmap, bytearray, memoryview)):
        # The ctypes view exports the buffer only for this line, so the mmap can still be closed later.
        view = (ctypes.c_char * len(region)).from_buffer(region)
        address = ctypes.addressof(view)
        del view
        return address, len(region)
    raise TypeError(f"register_host takes an mmap, a numpy array or a CPU tensor, not {type(region).__name__}")


def _device_address(host_address: int, nbytes: int, what: str) -> int:
    with _mappings_lock:
        for mapping in _mappings:
            address = mapping.device_address_of(host_address, nbytes)
            if address is not None:
                return address
    raise ValueError(
        f"{what} (host 0x{host_address:x}, {nbytes} bytes) is not inside host memory registered with register_host()"
    )


# ---- argument checks shared by both paths --------------------------------------------------------------


def _flag_layout(flags) -> tuple[int, int, int]:
    """(host address, count, stride in bytes) of a 1-D int64 array or CPU tensor of flags."""
    if isinstance(flags, torch.Tensor):
        if flags.is_cuda or flags.dtype != torch.int64 or flags.dim() != 1:
            raise ValueError("flags must be a 1-D int64 CPU tensor over shared memory")
        address, count, stride = flags.data_ptr(), flags.shape[0], flags.stride(0) * FLAG_BYTES
    elif isinstance(flags, np.ndarray):
        if flags.dtype != np.int64 or flags.ndim != 1:
            raise ValueError("flags must be a 1-D int64 array over shared memory")
        address, count, stride = flags.ctypes.data, flags.shape[0], flags.strides[0]
    else:
        raise TypeError(f"flags must be a numpy array or a CPU tensor, not {type(flags).__name__}")
    if count < 1 or address % FLAG_BYTES or (count > 1 and (stride <= 0 or stride % FLAG_BYTES)):
        raise ValueError("flags must be 8-byte aligned, at least one, at a positive stride that is a multiple of 8")
    return address, count, stride


def _check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.is_cuda:
        raise ValueError("dst must be a CPU tensor over (registered) shared memory")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("dst and src must be contiguous")
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"dst {dst.dtype}[{dst.numel()}] and src {src.dtype}[{src.numel()}] differ")


def _check_add(out: torch.Tensor, result: torch.Tensor, error: torch.Tensor) -> None:
    if out.dtype not in _DTYPE_CODES:
        raise ValueError(f"out must be float32, float16 or bfloat16, not {out.dtype}")
    if result.is_cuda or result.dtype != torch.float32:
        raise ValueError("result must be a float32 CPU tensor over (registered) shared memory")
    if out.dim() != 2 or result.shape != out.shape:
        raise ValueError(f"out {tuple(out.shape)} and result {tuple(result.shape)} must be the same 2-D shape")
    if out.numel() and (out.stride(1) != 1 or result.stride(1) != 1):
        raise ValueError("out and result rows must be contiguous (any row stride)")
    if error.dtype != torch.int64 or error.numel() != 1:
        raise ValueError("error must be a one-element int64 tensor")


def _stream_handle(stream, device: torch.device) -> int:
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def _check_device(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_cuda:
        raise ValueError(f"{what} must be a CUDA tensor")
    if tensor.device.index != torch.cuda.current_device():
        raise ValueError(f"{what} is on {tensor.device}, the current device is cuda:{torch.cuda.current_device()}")


# ---- fused CUDA path -----------------------------------------------------------------------------------


def fused_copy_and_signal(dst: torch.Tensor, src: torch.Tensor, flags, seq: int, stream=None) -> None:
    """One kernel on `stream` (default: the current one): copy `src` (CUDA, contiguous) into `dst`
    (same dtype and element count, a contiguous CPU view of registered shared memory), then store `seq`
    into every flag. Returns at once; the flags rise when the copy is visible to the CPU.

    Bytes moved: src.nbytes over PCIe (device -> host), at 16-byte stores when both ends are aligned.
    """
    _require_extension()
    _check_device(src, "src")
    _check_copy(dst, src)
    nbytes = src.numel() * src.element_size()
    flag_address, count, stride = _flag_layout(flags)
    _ext.copy_and_signal(
        _device_address(dst.data_ptr(), nbytes, "dst") if nbytes else 0,  # an empty tensor's data_ptr is 0
        src.data_ptr(),
        nbytes,
        _device_address(flag_address, (count - 1) * stride + FLAG_BYTES, "flags"),
        seq,
        _stream_handle(stream, src.device),
        count,
        stride,
    )


def fused_wait_and_add(
    out: torch.Tensor,
    result: torch.Tensor,
    flags,
    seq: int,
    error: torch.Tensor,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stream=None,
    skip_if_error: bool = False,
) -> None:
    """One kernel on `stream`: wait on the GPU until every flag >= `seq`, then `out += result`.

    out: [rows, cols] float32/float16/bfloat16 CUDA (rows contiguous, any row stride: a slice of a
    fused qkv output works); result: [rows, cols] float32 CPU view of registered shared memory (rows
    contiguous, any row stride: the exchange's padded output). Added in fp32, rounded once to out's dtype.
    error: int64 [1], CUDA or in registered host memory. After `timeout_s` the kernel adds nothing
    and stores `seq` into `error` if it holds 0 (the first failure wins; the caller resets it to 0).
    The host learns of it without a sync when `error` lies in registered host memory (read it after
    the step), or at the step's existing sync (sampling) for a CUDA tensor; the step's LoRA output is
    then incomplete and must be recomputed or its requests failed. `skip_if_error`: a wait that finds
    `error` already non-zero when it starts adds nothing and returns at once, so that one stalled
    worker costs a forward one timeout, not one per projection.
    """
    _require_extension()
    _check_device(out, "out")
    _check_add(out, result, error)
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    rows, cols = out.shape
    span = ((rows - 1) * result.stride(0) + cols) * 4 if result.numel() else 0
    flag_address, count, stride = _flag_layout(flags)
    if error.is_cuda:
        _check_device(error, "error")
        error_address = error.data_ptr()
    else:
        error_address = _device_address(error.data_ptr(), FLAG_BYTES, "error")
    _ext.wait_and_add(
        out.data_ptr(),
        _device_address(result.data_ptr(), span, "result") if span else 0,
        rows,
        cols,
        out.stride(0),
        result.stride(0),
        _DTYPE_CODES[out.dtype],
        _device_address(flag_address, (count - 1) * stride + FLAG_BYTES, "flags"),
        seq,
        _stream_handle(stream, out.device),
        max(1, int(timeout_s * 1e9)),
        error_address,
        count,
        stride,
        skip_if_error,
    )


class FusedLauncher:
    """`fused_copy_and_signal` / `fused_wait_and_add` for one registered region (an exchange segment), with
    the per-call Python cut to what changes between calls: the region's device address, the flags'
    device addresses (`flags()`, once per set of flags) and the error word's are worked out here once;
    a call takes host addresses and sizes, checks that they lie in the region, and launches. The CPU
    LoRA's fused path makes two calls per worker per projection: with the general functions' checks and
    lookups, ~35 us of Python each on the H100 host (`lorad bench ipc`'s host time), longer than the
    round trip itself.

    The caller guarantees what the general functions check: `src`, `out` on the current device, src
    contiguous, out rows contiguous, dtypes matching (copy: src's bytes land as they are)."""

    def __init__(self, mapping: HostMapping, error: torch.Tensor):
        _require_extension()
        self.host, self.end, self.device = mapping.host_address, mapping.host_address + mapping.nbytes, mapping.device_address
        if error.dtype != torch.int64 or error.numel() != 1:
            raise ValueError("error must be a one-element int64 tensor")
        self.error = error.data_ptr() if error.is_cuda else self._device(error.data_ptr(), FLAG_BYTES, "error")

    def _device(self, host_address: int, nbytes: int, what: str) -> int:
        if not self.host <= host_address <= self.end - nbytes:
            raise ValueError(f"{what} (host 0x{host_address:x}, {nbytes} bytes) lies outside the registered region")
        return self.device + host_address - self.host

    def flags(self, flags) -> tuple[int, int, int]:
        """(device address, count, stride in bytes) of flags inside the region, for the calls below."""
        address, count, stride = _flag_layout(flags)
        return self._device(address, (count - 1) * stride + FLAG_BYTES, "flags"), count, stride

    def copy_and_signal(self, dst_address: int, src: torch.Tensor, flags: tuple[int, int, int], seq: int | list[int],
                        stream: int) -> None:
        """`fused_copy_and_signal` of src's bytes to host address `dst_address` (in the region). seq: one for
        every flag, or a list of one per flag (workers' seqs differ: one launch serves several workers)."""
        nbytes = src.numel() * src.element_size()
        dst = self._device(dst_address, nbytes, "dst") if nbytes else 0
        if isinstance(seq, int):
            _ext.copy_and_signal(dst, src.data_ptr(), nbytes, flags[0], seq, stream, flags[1], flags[2])
        else:
            _ext.copy_and_signal(dst, src.data_ptr(), nbytes, flags[0], seq[0], stream, flags[1], flags[2], seq)

    def wait_and_add(self, out: torch.Tensor, result_address: int, result_row_stride: int, flags: tuple[int, int, int],
                     seq: int | list[int], timeout_ns: int, stream: int, skip_if_error: bool = False) -> None:
        """`fused_wait_and_add` into out [rows, cols] from the float32 rows at host `result_address` (in the
        region), `result_row_stride` floats apart. seq as in copy_and_signal."""
        rows, cols = out.shape
        span = ((rows - 1) * result_row_stride + cols) * 4 if rows and cols else 0
        result = self._device(result_address, span, "result") if span else 0
        if isinstance(seq, int):
            _ext.wait_and_add(out.data_ptr(), result, rows, cols, out.stride(0), result_row_stride, _DTYPE_CODES[out.dtype],
                              flags[0], seq, stream, timeout_ns, self.error, flags[1], flags[2], skip_if_error)
        else:
            _ext.wait_and_add(out.data_ptr(), result, rows, cols, out.stride(0), result_row_stride, _DTYPE_CODES[out.dtype],
                              flags[0], seq[0], stream, timeout_ns, self.error, flags[1], flags[2], skip_if_error, seq)


# ---- python path (CPU engine; CaraServe's "native" baseline on the GPU) -----------------------------


def python_copy_and_signal(dst: torch.Tensor, src: torch.Tensor, flags, seq: int, stream=None) -> None:
    """Same interface as `fused_copy_and_signal`. A CUDA `src` is copied asynchronously, then the host
    synchronises the stream before storing the flags: the sync the fused kernel removes."""
    _check_copy(dst, src)
    _flag_layout(flags)
    if src.is_cuda:
        stream = stream if stream is not None else torch.cuda.current_stream(src.device)
        with torch.cuda.stream(stream):
            dst.view(-1).copy_(src.view(-1), non_blocking=True)
        stream.synchronize()
    else:
        dst.view(-1).copy_(src.view(-1))
    flags[:] = seq  # data first, then the flags (x86-64 store order, see shm/flags.py)


def python_wait_and_add(
    out: torch.Tensor,
    result: torch.Tensor,
    flags,
    seq: int,
    error: torch.Tensor,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stream=None,
    skip_if_error: bool = False,
) -> None:
    """Same interface as `fused_wait_and_add`: the host waits for the flags, then adds (on `stream`
    for a CUDA `out`). On timeout it adds nothing and stores `seq` into `error` if it holds 0."""
    _check_add(out, result, error)
    _flag_layout(flags)
    if skip_if_error and int(error.view(-1)[0]) != 0:
        return
    if not _wait_flags(flags, seq, timeout_s):
        if int(error.view(-1)[0]) == 0:
            error.fill_(seq)
        log.warning("wait_and_add seq=%d timed out after %.3f s", seq, timeout_s)
        return
    if out.is_cuda:
        stream = stream if stream is not None else torch.cuda.current_stream(out.device)
        with torch.cuda.stream(stream):
            out.add_(result.to(out.device))
    else:
        out.add_(result)


def _wait_flags(flags, seq: int, timeout_s: float, spin_s: float = 50e-6, max_pause_s: float = 1e-3) -> bool:
    # Spin briefly, then sleep with a doubling pause (as shm.flags.Flag.wait does).
    start = time.monotonic()
    pause = 10e-6
    while int(flags.min()) < seq:
        now = time.monotonic()
        if now - start >= timeout_s:
            return False
        if now - start >= spin_s:
            time.sleep(min(pause, timeout_s - (now - start)))
            pause = min(pause * 2, max_pause_s)
    return True


# ---- the path in use -----------------------------------------------------------------------------------


_warned_fallback = False


def _fused_for(tensor: torch.Tensor) -> bool:
    global _warned_fallback
    if not tensor.is_cuda:
        return False
    if available():
        return True
    if not _warned_fallback:
        _warned_fallback = True
        log.warning("cpu_lora_invocation path=%r (host syncs per call)", invocation_path())
    return False


def copy_and_signal(dst: torch.Tensor, src: torch.Tensor, flags, seq: int, stream=None) -> None:
    """`fused_copy_and_signal` for a CUDA `src` where the extension is usable, else `python_copy_and_signal`."""
    path = fused_copy_and_signal if _fused_for(src) else python_copy_and_signal
    path(dst, src, flags, seq, stream)


def wait_and_add(
    out: torch.Tensor,
    result: torch.Tensor,
    flags,
    seq: int,
    error: torch.Tensor,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stream=None,
    skip_if_error: bool = False,
) -> None:
    """`fused_wait_and_add` for a CUDA `out` where the extension is usable, else `python_wait_and_add`."""
    path = fused_wait_and_add if _fused_for(out) else python_wait_and_add
    path(out, result, flags, seq, error, timeout_s, stream, skip_if_error)


# ---- page runs -----------------------------------------------------------------------------------------


def rows_copy_path() -> str:
    """How the page pool queues an adapter's runs of pages: "cuda-ext" (one driver call per run, `copy_rows`), or
    "torch: <why the extension cannot be used here>" (one torch copy per run)."""
    path = invocation_path()
    return "cuda-ext" if path == "fused-cuda" else "torch: " + path.removeprefix("python: ")


def copy_rows(dst: torch.Tensor, src: torch.Tensor, runs: np.ndarray, tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """dst[first : first + n] = src[offset : offset + n] for each row (offset, first, n) of `runs` (an int64 array [R, 3]),
    then tail[0] = tail[1] (a word such as a streamed layer's ready flag, after its pages): one DMA per run, queued on
    the current stream of dst's device from C++ (`rows_copy_path() == "cuda-ext"`). dst: a CUDA tensor; src: host
    (pinned, or pageable: then each run returns once the driver has staged it) or CUDA, rows of dst's size and dtype.
    Nothing waits for the device. Bounds are checked here, before anything is queued."""
    if dst.dim() != 2 or src.dim() != 2 or not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("copy_rows: dst and src must be contiguous 2-D tensors")
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_rows: src rows {src.dtype} x {src.shape[1]} differ from dst rows {dst.dtype} x {dst.shape[1]}")
    runs = np.ascontiguousarray(runs, dtype=np.int64)
    if runs.ndim != 2 or runs.shape[1] != 3:
        raise ValueError(f"copy_rows: runs must be [R, 3] (offset, first, length), got {runs.shape}")
    if len(runs):
        offsets, firsts, lengths = runs[:, 0], runs[:, 1], runs[:, 2]
        if lengths.min() <= 0 or offsets.min() < 0 or firsts.min() < 0:
            raise ValueError("copy_rows: runs need offsets and firsts >= 0 and lengths > 0")
        if (offsets + lengths).max() > src.shape[0] or (firsts + lengths).max() > dst.shape[0]:
            raise ValueError(f"copy_rows: a run reaches past src ({src.shape[0]} rows) or dst ({dst.shape[0]} rows)")
    _require_extension()
    if not dst.is_cuda:
        raise ValueError("copy_rows: dst must be a CUDA tensor")
    tail_dst = tail_src = tail_bytes = 0
    if tail is not None:
        target, source = tail
        if target.device != dst.device:
            raise ValueError(f"copy_rows: the tail's target is on {target.device}, dst on {dst.device}")
        tail_bytes = target.numel() * target.element_size()
        if not target.is_contiguous() or not source.is_contiguous() or source.numel() * source.element_size() != tail_bytes:
            raise ValueError("copy_rows: the tail's target and source must be contiguous and of one size")
        tail_dst, tail_src = target.data_ptr(), source.data_ptr()
    _ext.copy_rows(dst.device.index, dst.data_ptr(), src.data_ptr(), dst.shape[1] * dst.element_size(), runs.ctypes.data,
                   len(runs), tail_dst, tail_src, tail_bytes, torch.cuda.current_stream(dst.device).cuda_stream)

