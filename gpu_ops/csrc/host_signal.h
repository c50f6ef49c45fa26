// lorad's CUDA side of CPU-assisted LoRA (CaraServe §4.2): the launchers that host_signal.cu defines and
// bindings.cpp exposes to Python. Plain C++ types only, so that the bindings need no CUDA compiler.
// Every launcher only enqueues work on `stream` and returns: no host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lorad {

enum DtypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The most flags one copy_and_signal or wait_and_add may carry (one per worker).
constexpr int kMaxFlagSeqs = 64;

// Throws std::runtime_error("<what>: <CUDA error name>: <description>") when `status` is not success.
void check_cuda(int status, const char* what);

int device_count();                // cudaGetDeviceCount; throws when there is no usable driver/device
int runtime_version();             // cudaRuntimeGetVersion: 13000 for CUDA 13.0

void register_host(std::uintptr_t host_ptr, std::size_t nbytes);  // portable | mapped
void unregister_host(std::uintptr_t host_ptr);
std::uintptr_t device_pointer(std::uintptr_t host_ptr);

// Copies `nbytes` from device memory `src` to mapped host memory `dst`, then, once every block's
// stores are visible system-wide, stores `seq` into the `num_flags` (<= kMaxFlagSeqs) 64-bit flags at
// `flag`, `flag_stride` bytes apart (the workers' job flags); with `seqs` (one per flag), flag f gets
// seqs[f]. One kernel.
void copy_and_signal(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, std::uintptr_t flag,
                     std::int64_t seq, std::uintptr_t stream, int num_flags, std::int64_t flag_stride,
                     const std::vector<std::int64_t>& seqs);

// Waits (on the GPU) until every one of the `num_flags` flags is >= `seq` (flag f: seqs[f] when `seqs`
// is not empty), then
// out[r, c] += result[r, c] for r < nrows, c < ncols (result fp32 in mapped host memory, out in the
// dtype `dtype_code`; strides in elements). After `timeout_ns` it gives up, adds nothing and stores
// the seq it missed into the 64-bit word `error` (device or mapped host memory) if that word is 0. With
// `skip_if_error`, a wait that finds `error` non-zero when it starts gives up at once (adds nothing):
// one stalled worker costs a forward one timeout, not one per projection. One kernel.
void wait_and_add(std::uintptr_t out, std::uintptr_t result, std::int64_t nrows, std::int64_t ncols,
                  std::int64_t out_row_stride, std::int64_t result_row_stride, int dtype_code,
                  std::uintptr_t flag, std::int64_t seq, std::uintptr_t stream, std::int64_t timeout_ns,
                  std::uintptr_t error, int num_flags, std::int64_t flag_stride, bool skip_if_error,
                  const std::vector<std::int64_t>& seqs);

// Queues one host->device DMA per run on `stream`, the CUDA runtime's current device set to `device` first:
// for each int64 triple (src_row, dst_row, rows) of the `num_runs` at host address `runs`, rows * row_bytes
// bytes from src + src_row * row_bytes to dst + dst_row * row_bytes; then, when tail_bytes > 0, tail_bytes from
// tail_src to tail_dst (a small word such as a streamed layer's ready flag, after its pages). Addresses are
// unified (pinned or pageable host, device): a pageable source's copy returns once the driver has staged it,
// as cudaMemcpyAsync does. No kernel, no host synchronisation. The caller checks the bounds.
void copy_rows(int device, std::uintptr_t dst, std::uintptr_t src, std::int64_t row_bytes, std::uintptr_t runs,
               std::int64_t num_runs, std::uintptr_t tail_dst, std::uintptr_t tail_src, std::size_t tail_bytes,
               std::uintptr_t stream);

}  // namespace lorad
