// lorad.cpu_lora._lorad_cpu: a CPU LoRA worker's serving loop in C++, for the jobs it can serve alone.
//
// The Python worker (cpu_lora/worker.py) pays about 8 µs of interpreter work per job on top of its two
// matmuls: the wake-up from its poll loop, reading the descriptor, the per-job plan lookups, two torch
// dispatches, the done flag. For a small job (a few token rows at a small rank, the round trip that
// `lorad bench ipc` times) that is most of the worker's share of a layer invocation. `NativeLoop.serve`
// polls the job flag, reads the descriptor, computes `x @ A^T @ B^T` and publishes the done flag with
// no Python in between, for every job whose module the Python side has taught it (`learn`) and whose
// work (rows x rank) is at most `max_work`; it hands anything else back (a split part, a stop, an
// unknown or changed adapter, a larger job, a malformed descriptor), and the Python loop serves that
// job as before. So the Python path stays the one that validates and reports errors; this loop only
// ever serves jobs that path has already served for the same module and store generation.
//
// Memory ordering: the job flag is loaded with acquire and the done flag stored with release (on
// x86-64 both are plain moves, as shm/flags.py explains for the Python side), so the descriptor and
// input rows are read after the flag that published them, and the status and output rows are visible
// before the done flag. No libtorch, no CUDA: plain C++ with pybind11.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(__x86_64__)
#error "the native loop relies on x86-64 store ordering (TSO); CMakeLists.txt builds it there only"
#endif
#include <immintrin.h>
#define LORAD_PAUSE() _mm_pause()
// One build serves any x86-64 CPU: the loader picks the widest vector unit this CPU has (where the
// compiler can clone functions; else the baseline build).
#if defined(__has_attribute)
#if __has_attribute(target_clones)
#define LORAD_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
#endif
#ifndef LORAD_CLONES
#define LORAD_CLONES
#endif

namespace py = pybind11;

namespace lorad {
namespace {

// Descriptor and worker-line fields (int64 indices), as shm/exchange.py numbers them; the Python
// side checks that they agree before it builds a loop (`FIELDS`).
constexpr int kTag = 0, kAdapter = 1, kLayer = 2, kProj = 3, kRowStart = 4, kRowEnd = 5, kInFeatures = 6,
              kOutFeatures = 7, kInDtype = 8, kSplits = 10;
constexpr int kDoneSeq = 0, kStatus = 1, kHeartbeat = 2, kNativeJobs = 7;
constexpr std::int64_t kStop = -1, kStatusOk = 0;
constexpr std::int64_t kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2;
constexpr std::int64_t kMaxRank = 256;  // mid values of one row live on the stack
constexpr int kPollsPerClock = 64;      // polls of the job flag between two looks at the clock

enum Outcome : int { kNeedsPython = 0, kCold = 1, kIdle = 2 };

inline std::int64_t load_acquire(const std::int64_t* cell) { return __atomic_load_n(cell, __ATOMIC_ACQUIRE); }
inline void store_release(std::int64_t* cell, std::int64_t value) { __atomic_store_n(cell, value, __ATOMIC_RELEASE); }

inline std::int64_t monotonic_ns() {  // the clock of Python's time.monotonic_ns(), which the hot deadline uses
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

// out[i, :n] = (x[i, :k] @ a^T) @ bt for i < rows; a [rank, k], bt [rank, n] row-major fp32, rank <= kMaxRank.
// Per row: rank dot products of length k (16 independent partial sums, which the compiler vectorises),
// then rank scaled adds of bt's rows. Reads a and bt once per row: meant for a few rows, where a
// blocked GEMM has nothing to block and a torch call costs more than the arithmetic.
LORAD_CLONES void lora_rows_f32(
    const float* x, std::int64_t x_stride, const float* a, const float* bt, float* out, std::int64_t out_stride,
    std::int64_t rows, std::int64_t k, std::int64_t rank, std::int64_t n) {
  float mid[kMaxRank];
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * x_stride;
    for (std::int64_t r = 0; r < rank; ++r) {
      const float* ar = a + r * k;
      float partial[16] = {0};
      std::int64_t j = 0;
      for (; j + 16 <= k; j += 16)
        for (int l = 0; l < 16; ++l) partial[l] += xi[j + l] * ar[j + l];
      float sum = 0;
      for (; j < k; ++j) sum += xi[j] * ar[j];
      for (int l = 0; l < 16; ++l) sum += partial[l];
      mid[r] = sum;
    }
    float* oi = out + i * out_stride;
    std::fill(oi, oi + n, 0.0f);
    for (std::int64_t r = 0; r < rank; ++r) {
      const float m = mid[r];
      const float* br = bt + r * n;
      for (std::int64_t c = 0; c < n; ++c) oi[c] += m * br[c];
    }
  }
}

struct Module {
  const float* a;   // [rank, in] fp32, in the adapter store
  const float* bt;  // [rank, out] fp32
  std::int64_t rank, in_features, out_features;
};

struct ModuleKey {
  std::int64_t adapter, layer, proj;
  bool operator==(const ModuleKey& other) const {
    return adapter == other.adapter && layer == other.layer && proj == other.proj;
  }
};

struct ModuleKeyHash {
  std::size_t operator()(const ModuleKey& key) const {
    return std::hash<std::int64_t>()(key.adapter * 1000003LL + key.layer * 131LL + key.proj);
  }
};

}  // namespace

// One worker's loop over its slot of the exchange segment. Addresses are of this process's mappings of
// the exchange and the adapter store; they must outlive the object (the worker closes both after it).
class NativeLoop {
 public:
  NativeLoop(std::uintptr_t job_flag, std::uintptr_t worker_line, std::uintptr_t ring, std::int64_t ring_entries,
             std::int64_t descriptor_words, std::uintptr_t hot_until, std::uintptr_t input, std::int64_t input_bytes,
             std::uintptr_t output, std::int64_t out_stride, std::int64_t max_tokens, std::uintptr_t store_generation,
             std::int64_t max_work)
      : job_flag_(reinterpret_cast<std::int64_t*>(job_flag)),
        worker_line_(reinterpret_cast<std::int64_t*>(worker_line)),
        ring_(reinterpret_cast<const std::int64_t*>(ring)),
        ring_entries_(ring_entries),
        descriptor_words_(descriptor_words),
        hot_until_(reinterpret_cast<const std::int64_t*>(hot_until)),
        input_(reinterpret_cast<const unsigned char*>(input)),
        input_bytes_(input_bytes),
        output_(reinterpret_cast<float*>(output)),
        out_stride_(out_stride),
        max_tokens_(max_tokens),
        store_generation_(reinterpret_cast<const std::int64_t*>(store_generation)),
        max_work_(max_work) {
    if (ring_entries < 1 || descriptor_words <= kSplits || out_stride < 1 || max_tokens < 1 || max_work < 0)
      throw std::invalid_argument("NativeLoop: bad layout");
  }

  // Serve the module (adapter, layer, proj) from now on: A at `a` [rank, in], B^T at `bt` [rank, out],
  // as the store's index of `generation` placed them. A new generation forgets every module learnt
  // under the old one (the store moved or removed some adapter since). The caller bounds the table
  // (`forget`).
  void learn(std::int64_t adapter, std::int64_t layer, std::int64_t proj, std::uintptr_t a, std::uintptr_t bt,
             std::int64_t rank, std::int64_t in_features, std::int64_t out_features, std::int64_t generation) {
    if (rank < 1 || rank > kMaxRank || in_features < 1 || out_features < 1 || out_features > out_stride_) return;
    if (generation != generation_) {
      modules_.clear();
      generation_ = generation;
    }
    modules_[ModuleKey{adapter, layer, proj}] = Module{reinterpret_cast<const float*>(a),
                                                        reinterpret_cast<const float*>(bt), rank, in_features,
                                                        out_features};
  }

  void forget() { modules_.clear(); }

  // Serve jobs seq + 1, seq + 2, ... as they are raised, while the pool is hot. Returns (the last seq
  // served, why it stopped): kNeedsPython, job seq + 1 is raised and Python must serve it; kCold, no
  // job and the hot period is over (Python sleeps); kIdle, no job for idle_ns (Python's housekeeping:
  // the heartbeat, the parent's liveness). A cold pool returns at once.
  std::pair<std::int64_t, int> serve(std::int64_t seq, std::int64_t idle_ns) {
    std::int64_t idle_until = monotonic_ns() + idle_ns;
    int polls = kPollsPerClock - 1;  // the first idle poll looks at the clock
    while (true) {
      if (load_acquire(job_flag_) > seq) {
        if (!serve_one(seq + 1)) return {seq, kNeedsPython};
        ++seq;
        idle_until = monotonic_ns() + idle_ns;
        polls = 0;
        continue;
      }
      if (++polls < kPollsPerClock) {
        LORAD_PAUSE();
        continue;
      }
      polls = 0;
      const std::int64_t now = monotonic_ns();
      if (now >= load_acquire(hot_until_)) return {seq, kCold};
      if (now >= idle_until) return {seq, kIdle};
    }
  }

  // The arithmetic alone (no flags), for tests and for the worker's calibration against torch.
  static void compute(std::uintptr_t x, std::int64_t x_stride, std::uintptr_t a, std::uintptr_t bt,
                      std::uintptr_t out, std::int64_t out_stride, std::int64_t rows, std::int64_t in_features,
                      std::int64_t rank, std::int64_t out_features) {
    if (rank < 1 || rank > kMaxRank) throw std::invalid_argument("rank must be 1.." + std::to_string(kMaxRank));
    lora_rows_f32(reinterpret_cast<const float*>(x), x_stride, reinterpret_cast<const float*>(a),
                  reinterpret_cast<const float*>(bt), reinterpret_cast<float*>(out), out_stride, rows, in_features,
                  rank, out_features);
  }

 private:
  // Job `next` if this loop may serve it: true once its output rows, status and done flag are written.
  bool serve_one(std::int64_t next) {
    const std::int64_t* d = ring_ + (next % ring_entries_) * descriptor_words_;
    if (d[kTag] != next || d[kAdapter] == kStop || d[kSplits] != 1) return false;
    if (load_acquire(store_generation_) != generation_) return false;
    const auto found = modules_.find(ModuleKey{d[kAdapter], d[kLayer], d[kProj]});
    if (found == modules_.end()) return false;
    const Module& module = found->second;
    const std::int64_t start = d[kRowStart], end = d[kRowEnd], dtype = d[kInDtype];
    const std::int64_t rows = end - start, k = d[kInFeatures], n = d[kOutFeatures];
    if (k != module.in_features || n != module.out_features || start < 0 || end < start || end > max_tokens_)
      return false;
    if (rows * module.rank > max_work_) return false;
    const std::int64_t itemsize = dtype == kFloat32 ? 4 : (dtype == kFloat16 || dtype == kBFloat16) ? 2 : 0;
    if (itemsize == 0 || end * k * itemsize > input_bytes_) return false;
    const unsigned char* x = input_ + start * k * itemsize;  // the job's compact rows: row r at r * k * itemsize
    float* out = output_ + start * out_stride_;
    if (dtype == kFloat32) {
      lora_rows_f32(reinterpret_cast<const float*>(x), k, module.a, module.bt, out, out_stride_, rows, k, module.rank,
                    n);
    } else {
      staging_.resize(static_cast<std::size_t>(k));
      for (std::int64_t i = 0; i < rows; ++i) {
        widen(x + i * k * itemsize, dtype, k);
        lora_rows_f32(staging_.data(), k, module.a, module.bt, out + i * out_stride_, out_stride_, 1, k, module.rank,
                      n);
      }
    }
    worker_line_[kNativeJobs] += 1;
    worker_line_[kHeartbeat] += 1;  // as the Python loop beats once per wake-up: a worker busy for long is alive
    worker_line_[kStatus] = kStatusOk;
    store_release(worker_line_ + kDoneSeq, next);
    return true;
  }

  // One input row of 16-bit floats into staging_ as fp32 (the Python path computes in fp32 too).
  void widen(const unsigned char* row, std::int64_t dtype, std::int64_t k) {
    float* to = staging_.data();
    if (dtype == kBFloat16) {
      const std::uint16_t* from = reinterpret_cast<const std::uint16_t*>(row);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::uint32_t bits = static_cast<std::uint32_t>(from[j]) << 16;
        __builtin_memcpy(to + j, &bits, 4);
      }
    } else {
#if defined(__FLT16_MAX__) && !defined(LORAD_PORTABLE_HALF)  // the compiler has _Float16 (GCC 12+, Clang 15+)
      const _Float16* from = reinterpret_cast<const _Float16*>(row);
      for (std::int64_t j = 0; j < k; ++j) to[j] = static_cast<float>(from[j]);
#else
      const std::uint16_t* from = reinterpret_cast<const std::uint16_t*>(row);
      for (std::int64_t j = 0; j < k; ++j) to[j] = half_to_float(from[j]);
#endif
    }
  }

  // IEEE binary16 -> binary32, exact, for compilers without _Float16.
  static float half_to_float(std::uint16_t half) {
    const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
    const std::uint32_t exponent = (half >> 10) & 0x1fu;
    std::uint32_t mantissa = half & 0x3ffu, bits;
    if (exponent == 0x1fu) {
      bits = sign | 0x7f800000u | (mantissa << 13);  // infinity, NaN
    } else if (exponent != 0) {
      bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // normal: rebias 15 -> 127
    } else if (mantissa == 0) {
      bits = sign;  // zero
    } else {  // subnormal: mantissa x 2^-24, normalised
      std::uint32_t shift = 0;
      while (!(mantissa & 0x400u)) {
        mantissa <<= 1;
        ++shift;
      }
      bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float value;
    __builtin_memcpy(&value, &bits, 4);
    return value;
  }

  std::int64_t* job_flag_;
  std::int64_t* worker_line_;
  const std::int64_t* ring_;
  std::int64_t ring_entries_, descriptor_words_;
  const std::int64_t* hot_until_;
  const unsigned char* input_;
  std::int64_t input_bytes_;
  float* output_;
  std::int64_t out_stride_, max_tokens_;
  const std::int64_t* store_generation_;
  std::int64_t max_work_;
  std::int64_t generation_ = -1;
  std::unordered_map<ModuleKey, Module, ModuleKeyHash> modules_;
  std::vector<float> staging_;
};

}  // namespace lorad

PYBIND11_MODULE(_lorad_cpu, m) {
  using lorad::NativeLoop;
  m.doc() = "lorad's native CPU LoRA worker loop (cpu_lora/csrc/native_loop.cpp)";
  m.attr("NEEDS_PYTHON") = static_cast<int>(lorad::kNeedsPython);
  m.attr("COLD") = static_cast<int>(lorad::kCold);
  m.attr("IDLE") = static_cast<int>(lorad::kIdle);
  m.attr("MAX_RANK") = lorad::kMaxRank;
  // Field indices this loop assumes (descriptor: tag .. splits; worker line: done, status, heartbeat,
  // native jobs), for the Python side to check against shm/exchange.py.
  py::dict fields;
  fields["TAG"] = lorad::kTag;
  fields["ADAPTER"] = lorad::kAdapter;
  fields["LAYER"] = lorad::kLayer;
  fields["PROJ"] = lorad::kProj;
  fields["ROW_START"] = lorad::kRowStart;
  fields["ROW_END"] = lorad::kRowEnd;
  fields["IN_FEATURES"] = lorad::kInFeatures;
  fields["OUT_FEATURES"] = lorad::kOutFeatures;
  fields["IN_DTYPE"] = lorad::kInDtype;
  fields["SPLITS"] = lorad::kSplits;
  fields["DONE_SEQ"] = lorad::kDoneSeq;
  fields["STATUS"] = lorad::kStatus;
  fields["HEARTBEAT"] = lorad::kHeartbeat;
  fields["NATIVE_JOBS"] = lorad::kNativeJobs;
  fields["STOP"] = lorad::kStop;
  fields["STATUS_OK"] = lorad::kStatusOk;
  fields["IN_FLOAT32"] = lorad::kFloat32;
  fields["IN_FLOAT16"] = lorad::kFloat16;
  fields["IN_BFLOAT16"] = lorad::kBFloat16;
  m.attr("FIELDS") = fields;
  py::class_<NativeLoop>(m, "NativeLoop")
      .def(py::init<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::int64_t, std::int64_t, std::uintptr_t,
                    std::uintptr_t, std::int64_t, std::uintptr_t, std::int64_t, std::int64_t, std::uintptr_t,
                    std::int64_t>(),
           py::arg("job_flag"), py::arg("worker_line"), py::arg("ring"), py::arg("ring_entries"),
           py::arg("descriptor_words"), py::arg("hot_until"), py::arg("input"), py::arg("input_bytes"),
           py::arg("output"), py::arg("out_stride"), py::arg("max_tokens"), py::arg("store_generation"),
           py::arg("max_work"))
      .def("learn", &NativeLoop::learn, py::arg("adapter"), py::arg("layer"), py::arg("proj"), py::arg("a"),
           py::arg("bt"), py::arg("rank"), py::arg("in_features"), py::arg("out_features"), py::arg("generation"))
      .def("forget", &NativeLoop::forget)
      .def("serve", &NativeLoop::serve, py::arg("seq"), py::arg("idle_ns"))
      .def_static("compute", &NativeLoop::compute, py::arg("x"), py::arg("x_stride"), py::arg("a"), py::arg("bt"),
                  py::arg("out"), py::arg("out_stride"), py::arg("rows"), py::arg("in_features"), py::arg("rank"),
                  py::arg("out_features"));
}
