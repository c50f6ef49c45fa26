// The two kernels of sync-free CPU LoRA invocation (CaraServe §4.2, Fig. 8 bottom), and their launchers.
//
// copy_and_signal: the engine's activations go from device memory into the shared-memory exchange
// (mapped pinned host memory) and the workers' job flags are raised, in ONE kernel queued behind the
// kernel that produced the activations. The host never waits: stream order guarantees the data is
// ready when the kernel runs, and the kernel raises the flags only after all its blocks' stores are
// visible to the CPU.
// wait_and_add: queued behind the base projection's GEMM, it waits on the GPU for the workers' done
// flags and adds their fp32 result into the projection output. The host never waits here either.
//
// Grid-wide ordering uses a small per-stream state word block in device memory (`g_stream_state`):
// kernels on one stream run one after another, so each kernel owns its stream's state while it runs
// and leaves it zeroed for the next one.

#include "host_signal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace lorad {
namespace {

constexpr int kThreads = 256;
constexpr int kCopyUnroll = 4;       // independent 16-byte loads in flight per thread
constexpr int kMaxStreams = 1024;     // distinct streams one process may use these kernels on
constexpr unsigned kPollMinNs = 64;   // first pause between two polls of a host flag
constexpr unsigned kPollMaxNs = 1024; // then the poller reads host memory over PCIe every ~1 µs + a round trip

// Each flag's own seq, passed by value (kernel parameters: no copy to the device first). A worker's seqs
// count its own jobs, so one kernel for many workers stores (and waits for) a different value per flag.
struct FlagSeqs {
  long long value[kMaxFlagSeqs];
};

struct StreamState {
  unsigned copy_blocks_done;  // copy_and_signal: blocks whose stores are fenced
  unsigned wait_claim;        // wait_and_add: 1 once a block has become the poller
  unsigned wait_outcome;      // 0 pending, 1 flags reached, 2 timed out
  unsigned wait_blocks_done;  // blocks finished, so that the last one resets the state
};

// Zero at module load (per device); every kernel returns its slot to zero before it ends.
__device__ StreamState g_stream_state[kMaxStreams];

enum : unsigned { kPending = 0, kReady = 1, kTimedOut = 2 };

// ---- memory-model helpers (PTX ISA, "Memory Consistency Model") ----------------------------------

__device__ __forceinline__ long long load_acquire_sys(const long long* address) {
  long long value;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_relaxed_sys(long long* address, long long value) {
  asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_gpu(unsigned* address, unsigned value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned add_acq_rel_gpu(unsigned* address, unsigned value) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
}

__device__ __forceinline__ unsigned long long global_time_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// ---- copy_and_signal ---------------------------------------------------------------------------------

// `Word` is the widest of uint4 / uint2 / unsigned / unsigned char that divides both addresses; the
// 0..15 bytes past the last whole word are copied byte by byte by block 0.
template <typename Word>
__global__ void __launch_bounds__(kThreads) copy_and_signal_kernel(
    Word* __restrict__ dst, const Word* __restrict__ src, std::size_t words, unsigned char* __restrict__ dst_tail,
    const unsigned char* __restrict__ src_tail, unsigned tail_bytes, long long* flag, int num_flags,
    std::int64_t flag_stride_words, FlagSeqs seqs, StreamState* state) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads * kCopyUnroll;
  for (std::size_t base = static_cast<std::size_t>(blockIdx.x) * kThreads * kCopyUnroll + threadIdx.x; base < words;
       base += stride) {
    Word staged[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(u) * kThreads;
      if (i < words) staged[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(u) * kThreads;
      if (i < words) dst[i] = staged[u];
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < tail_bytes) dst_tail[threadIdx.x] = src_tail[threadIdx.x];

  // Each thread's stores to host memory are performed system-wide before it reaches the barrier;
  // after the barrier one thread per block counts the block in. The block that counts last has,
  // through the acq_rel atomic, seen every other block's fenced stores, and raises the flags.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (add_acq_rel_gpu(&state->copy_blocks_done, 1) != gridDim.x - 1) return;
  state->copy_blocks_done = 0;  // the next kernel on this stream starts after this one ends
  __threadfence_system();
  for (int f = 0; f < num_flags; ++f) store_relaxed_sys(flag + f * flag_stride_words, seqs.value[f]);
}

// ---- wait_and_add ------------------------------------------------------------------------------------

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <>
struct Convert<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Convert<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// -1 once every flag f is >= seqs.value[f]; after timeout_ns, the first flag still short of its seq.
// Called by the 32 lanes of one warp together: lane l reads flags l, l + 32, ..., so one poll costs one
// PCIe round trip however many workers there are (read one after another, 8 flags took ~8). Every lane
// returns the same answer. Pauses double from kPollMinNs to kPollMaxNs.
__device__ int poll_flags_warp(const long long* flag, int num_flags, std::int64_t flag_stride_words,
                               const FlagSeqs& seqs, long long timeout_ns) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const unsigned long long start = global_time_ns();
  unsigned pause = kPollMinNs;
  int first_short = num_flags;  // this lane's first flag short of its seq; num_flags: none
  for (int f = lane; f < num_flags; f += 32) {
    if (load_acquire_sys(flag + f * flag_stride_words) < seqs.value[f]) {
      first_short = f;
      break;
    }
  }
  while (true) {
    int lowest = first_short;
    for (int offset = 16; offset > 0; offset /= 2) lowest = min(lowest, __shfl_xor_sync(0xffffffffu, lowest, offset));
    if (lowest == num_flags) return -1;
    if (static_cast<long long>(global_time_ns() - start) > timeout_ns) return lowest;
    __nanosleep(pause);
    pause = min(pause * 2, kPollMaxNs);
    // a lane's flags below first_short were reached already, and flags only grow
    for (int f = first_short; f < num_flags; f += 32) {
      if (load_acquire_sys(flag + f * flag_stride_words) < seqs.value[f]) break;
      first_short = f + 32 < num_flags ? f + 32 : num_flags;
    }
  }
}

// One block (the first to start) polls the host flags over PCIe, with one warp; the others wait on its
// verdict in device memory, so a wait costs one PCIe round trip every few microseconds however large the
// grid is. Whichever block claims the poll is running, so the others can never wait on a block not yet
// started. The polling lanes' acquire loads are ordered before the block's barrier, and the verdict's
// release store after it: whoever sees the verdict (this block after the barrier, the others through
// the acquire of wait_outcome) sees every worker's result.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) wait_and_add_kernel(
    T* out, const float* result, std::int64_t nrows, std::int64_t ncols, std::int64_t out_row_stride,
    std::int64_t result_row_stride, const long long* flag, int num_flags, std::int64_t flag_stride_words,
    FlagSeqs seqs, long long timeout_ns, long long* error, bool skip_if_error, StreamState* state) {
  __shared__ unsigned outcome;
  __shared__ bool poller;
  __shared__ int short_flag;
  if (threadIdx.x == 0) poller = atomicCAS(&state->wait_claim, 0u, 1u) == 0u;
  __syncthreads();
  if (poller) {
    if (threadIdx.x < 32) {
      // skip_if_error: an earlier wait of this forward already timed out (its step is recomputed
      // anyway), so give up at once instead of spending another timeout per later projection.
      const bool skip = __shfl_sync(0xffffffffu, threadIdx.x == 0 && skip_if_error && load_acquire_sys(error) != 0, 0);
      const int shortest = skip ? 0 : poll_flags_warp(flag, num_flags, flag_stride_words, seqs, timeout_ns);
      if (threadIdx.x == 0) {
        outcome = skip || shortest >= 0 ? kTimedOut : kReady;
        short_flag = shortest < 0 ? 0 : shortest;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (outcome == kTimedOut) {
        // Only the poller writes the word, and kernels on one stream do not overlap: no atomic is
        // needed, which matters because atomics on host memory across PCIe are not portable.
        if (*reinterpret_cast<volatile long long*>(error) == 0) store_relaxed_sys(error, seqs.value[short_flag]);
        __threadfence_system();
      }
      store_release_gpu(&state->wait_outcome, outcome);
    }
  } else if (threadIdx.x == 0) {
    unsigned seen;
    while ((seen = load_acquire_gpu(&state->wait_outcome)) == kPending) __nanosleep(kPollMinNs);
    outcome = seen;
  }
  __syncthreads();

  if (outcome == kReady) {
    const std::int64_t packs_per_row = ncols / N;
    const std::int64_t packs = nrows * packs_per_row;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < packs;
         i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
      const std::int64_t row = i / packs_per_row;
      const std::int64_t col = (i - row * packs_per_row) * N;
      const float* from = result + row * result_row_stride + col;
      float add[N];
      if constexpr (N == 4) {
        // .cv: fetch again, never from a cached copy of host memory the CPU has since rewritten.
        const float4 v = __ldcv(reinterpret_cast<const float4*>(from));
        add[0] = v.x, add[1] = v.y, add[2] = v.z, add[3] = v.w;
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) add[k] = __ldcv(from + k);
      }
      Pack<T, N>* to = reinterpret_cast<Pack<T, N>*>(out + row * out_row_stride + col);
      Pack<T, N> pack = *to;
#pragma unroll
      for (int k = 0; k < N; ++k) pack.v[k] = Convert<T>::store(Convert<T>::load(pack.v[k]) + add[k]);
      *to = pack;
    }
  }

  // The last block out resets the stream's state for the next wait_and_add on it.
  __syncthreads();
  if (threadIdx.x == 0 && add_acq_rel_gpu(&state->wait_blocks_done, 1) == gridDim.x - 1) {
    state->wait_claim = 0;
    state->wait_outcome = kPending;
    state->wait_blocks_done = 0;
  }
}

// ---- host side ---------------------------------------------------------------------------------------

// Each distinct stream gets its own slot of g_stream_state. Streams are few and long-lived (the
// engine's compute stream); a destroyed stream's handle reused by a new one simply shares its slot,
// which is safe because the state is zero between kernels.
StreamState* stream_state(cudaStream_t stream) {
  static std::mutex mutex;
  static std::unordered_map<cudaStream_t, int> slots;
  int slot;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = slots.find(stream);
    if (found == slots.end()) {
      if (static_cast<int>(slots.size()) >= kMaxStreams)
        throw std::runtime_error("lorad CUDA ops: more than " + std::to_string(kMaxStreams) + " streams used");
      found = slots.emplace(stream, static_cast<int>(slots.size())).first;
    }
    slot = found->second;
  }
  StreamState* base = nullptr;
  check_cuda(cudaGetSymbolAddress(reinterpret_cast<void**>(&base), g_stream_state), "cudaGetSymbolAddress");
  return base + slot;
}

int multiprocessor_count() {
  int device = 0, count = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count;
}

unsigned grid_for(std::int64_t items_per_block_pass, std::int64_t items) {
  const std::int64_t wanted = std::max<std::int64_t>(1, (items + items_per_block_pass - 1) / items_per_block_pass);
  return static_cast<unsigned>(std::min<std::int64_t>(wanted, 2LL * multiprocessor_count()));
}

template <typename Word>
void launch_copy(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, long long* flag, int num_flags,
                 std::int64_t flag_stride_words, const FlagSeqs& seqs, cudaStream_t stream) {
  const std::size_t words = nbytes / sizeof(Word);
  const std::size_t body = words * sizeof(Word);
  const unsigned grid = grid_for(static_cast<std::int64_t>(kThreads) * kCopyUnroll, static_cast<std::int64_t>(words));
  copy_and_signal_kernel<Word><<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<Word*>(dst), reinterpret_cast<const Word*>(src), words,
      reinterpret_cast<unsigned char*>(dst + body), reinterpret_cast<const unsigned char*>(src + body),
      static_cast<unsigned>(nbytes - body), flag, num_flags, flag_stride_words, seqs, stream_state(stream));
  check_cuda(cudaGetLastError(), "copy_and_signal launch");
}

template <typename T>
void launch_add(std::uintptr_t out, std::uintptr_t result, std::int64_t nrows, std::int64_t ncols,
                std::int64_t out_row_stride, std::int64_t result_row_stride, const long long* flag, int num_flags,
                std::int64_t flag_stride_words, const FlagSeqs& seqs, long long timeout_ns, long long* error,
                bool skip_if_error, cudaStream_t stream) {
  // Four columns at a time (16-byte result loads) when every row start is aligned for it.
  const bool vector = ncols % 4 == 0 && out_row_stride % 4 == 0 && result_row_stride % 4 == 0 &&
                      out % (4 * sizeof(T)) == 0 && result % 16 == 0;
  const int width = vector ? 4 : 1;
  const unsigned grid = grid_for(kThreads, nrows * (ncols / width));
  StreamState* state = stream_state(stream);
  if (vector) {
    wait_and_add_kernel<T, 4><<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<T*>(out), reinterpret_cast<const float*>(result), nrows, ncols, out_row_stride,
        result_row_stride, flag, num_flags, flag_stride_words, seqs, timeout_ns, error, skip_if_error, state);
  } else {
    wait_and_add_kernel<T, 1><<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<T*>(out), reinterpret_cast<const float*>(result), nrows, ncols, out_row_stride,
        result_row_stride, flag, num_flags, flag_stride_words, seqs, timeout_ns, error, skip_if_error, state);
  }
  check_cuda(cudaGetLastError(), "wait_and_add launch");
}

// The flags' seqs: `seqs` (one per flag) when given, else `seq` for every flag.
FlagSeqs flag_seqs(std::int64_t seq, const std::vector<std::int64_t>& seqs, int num_flags) {
  if (num_flags > kMaxFlagSeqs)
    throw std::invalid_argument("num_flags must be at most " + std::to_string(kMaxFlagSeqs));
  if (!seqs.empty() && static_cast<int>(seqs.size()) != num_flags)
    throw std::invalid_argument("seqs must hold one seq per flag (num_flags), or be empty");
  FlagSeqs out{};
  for (int f = 0; f < num_flags; ++f) out.value[f] = seqs.empty() ? seq : seqs[f];
  return out;
}

void check_flags(std::uintptr_t flag, int num_flags, std::int64_t flag_stride) {
  if (num_flags < 1) throw std::invalid_argument("num_flags must be at least 1");
  if (flag == 0 || flag % 8 != 0) throw std::invalid_argument("a flag must be a non-null, 8-byte aligned address");
  if (num_flags > 1 && (flag_stride <= 0 || flag_stride % 8 != 0))
    throw std::invalid_argument("flag_stride must be a positive multiple of 8 bytes");
}

}  // namespace

void check_cuda(int status, const char* what) {
  if (status == cudaSuccess) return;
  const auto error = static_cast<cudaError_t>(status);
  throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error));
}

int device_count() {
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

int runtime_version() {
  int version = 0;
  check_cuda(cudaRuntimeGetVersion(&version), "cudaRuntimeGetVersion");
  return version;
}

void register_host(std::uintptr_t host_ptr, std::size_t nbytes) {
  check_cuda(cudaHostRegister(reinterpret_cast<void*>(host_ptr), nbytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
             "cudaHostRegister");
}

void unregister_host(std::uintptr_t host_ptr) {
  check_cuda(cudaHostUnregister(reinterpret_cast<void*>(host_ptr)), "cudaHostUnregister");
}

std::uintptr_t device_pointer(std::uintptr_t host_ptr) {
  void* device = nullptr;
  check_cuda(cudaHostGetDevicePointer(&device, reinterpret_cast<void*>(host_ptr), 0), "cudaHostGetDevicePointer");
  return reinterpret_cast<std::uintptr_t>(device);
}

void copy_and_signal(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, std::uintptr_t flag,
                     std::int64_t seq, std::uintptr_t stream_handle, int num_flags, std::int64_t flag_stride,
                     const std::vector<std::int64_t>& seqs) {
  check_flags(flag, num_flags, flag_stride);
  const FlagSeqs values = flag_seqs(seq, seqs, num_flags);
  if (nbytes > 0 && (dst == 0 || src == 0)) throw std::invalid_argument("copy_and_signal: null pointer");
  auto* flags = reinterpret_cast<long long*>(flag);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const std::uintptr_t both = dst | src;
  const std::int64_t stride_words = flag_stride / 8;
  if (both % 16 == 0)
    launch_copy<uint4>(dst, src, nbytes, flags, num_flags, stride_words, values, stream);
  else if (both % 8 == 0)
    launch_copy<uint2>(dst, src, nbytes, flags, num_flags, stride_words, values, stream);
  else if (both % 4 == 0)
    launch_copy<unsigned>(dst, src, nbytes, flags, num_flags, stride_words, values, stream);
  else
    launch_copy<unsigned char>(dst, src, nbytes, flags, num_flags, stride_words, values, stream);
}

void wait_and_add(std::uintptr_t out, std::uintptr_t result, std::int64_t nrows, std::int64_t ncols,
                  std::int64_t out_row_stride, std::int64_t result_row_stride, int dtype_code, std::uintptr_t flag,
                  std::int64_t seq, std::uintptr_t stream_handle, std::int64_t timeout_ns, std::uintptr_t error,
                  int num_flags, std::int64_t flag_stride, bool skip_if_error, const std::vector<std::int64_t>& seqs) {
  check_flags(flag, num_flags, flag_stride);
  const FlagSeqs values = flag_seqs(seq, seqs, num_flags);
  if (nrows < 0 || ncols < 0) throw std::invalid_argument("wait_and_add: negative shape");
  if (out_row_stride < ncols || result_row_stride < ncols)
    throw std::invalid_argument("wait_and_add: a row stride is smaller than ncols");
  if (timeout_ns <= 0) throw std::invalid_argument("wait_and_add: timeout_ns must be positive (a wait never hangs)");
  if (error == 0 || error % 8 != 0) throw std::invalid_argument("wait_and_add: error must be an 8-byte aligned address");
  if (nrows * ncols > 0 && (out == 0 || result == 0 || result % 4 != 0))
    throw std::invalid_argument("wait_and_add: null or misaligned pointer");
  auto* flags = reinterpret_cast<const long long*>(flag);
  auto* error_word = reinterpret_cast<long long*>(error);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const std::int64_t stride_words = flag_stride / 8;
  switch (dtype_code) {
    case kFloat32:
      launch_add<float>(out, result, nrows, ncols, out_row_stride, result_row_stride, flags, num_flags, stride_words, values,
                        timeout_ns, error_word, skip_if_error, stream);
      break;
    case kFloat16:
      launch_add<__half>(out, result, nrows, ncols, out_row_stride, result_row_stride, flags, num_flags, stride_words,
                         values, timeout_ns, error_word, skip_if_error, stream);
      break;
    case kBFloat16:
      launch_add<__nv_bfloat16>(out, result, nrows, ncols, out_row_stride, result_row_stride, flags, num_flags,
                                stride_words, values, timeout_ns, error_word, skip_if_error, stream);
      break;
    default:
      throw std::invalid_argument("wait_and_add: dtype_code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  }
}

void copy_rows(int device, std::uintptr_t dst, std::uintptr_t src, std::int64_t row_bytes, std::uintptr_t runs,
               std::int64_t num_runs, std::uintptr_t tail_dst, std::uintptr_t tail_src, std::size_t tail_bytes,
               std::uintptr_t stream_handle) {
  if (row_bytes <= 0 || num_runs < 0) throw std::invalid_argument("copy_rows: row_bytes must be positive, num_runs >= 0");
  if (num_runs > 0 && (dst == 0 || src == 0 || runs == 0)) throw std::invalid_argument("copy_rows: null pointer");
  if (tail_bytes > 0 && (tail_dst == 0 || tail_src == 0)) throw std::invalid_argument("copy_rows: null tail pointer");
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const auto* triples = reinterpret_cast<const std::int64_t*>(runs);
  auto* to = reinterpret_cast<char*>(dst);
  const auto* from = reinterpret_cast<const char*>(src);
  for (std::int64_t i = 0; i < num_runs; ++i) {
    const std::int64_t src_row = triples[3 * i], dst_row = triples[3 * i + 1], rows = triples[3 * i + 2];
    check_cuda(cudaMemcpyAsync(to + dst_row * row_bytes, from + src_row * row_bytes,
                               static_cast<std::size_t>(rows * row_bytes), cudaMemcpyDefault, stream),
               "copy_rows: cudaMemcpyAsync");
  }
  if (tail_bytes > 0)
    check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(tail_dst), reinterpret_cast<const void*>(tail_src), tail_bytes,
                               cudaMemcpyDefault, stream),
               "copy_rows: cudaMemcpyAsync (tail)");
}

}  // namespace lorad
