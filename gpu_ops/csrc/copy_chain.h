// Host->device copies issued by a native thread: a streamed adapter placement (gpu_ops/page_pool.py,
// AdapterTable.place_streamed) queues its layers' pages and its `ready` words this way. Device kernels spin
// on those words, so the thread that issues the copies must never wait for the Python interpreter: a
// Python loader thread could sit behind an engine thread that blocks on the device while holding the GIL,
// and the kernel would wait for a copy that could never be issued. Plain C++ types only (see host_signal.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace lorad {

struct CopyOp {
  std::uintptr_t dst;  // device address
  std::uintptr_t src;  // host address, pinned or pageable
  std::size_t nbytes;
};

// One chain of copies on one stream, issued in order by its own thread (cudaMemcpyAsync; from pageable
// memory the runtime stages each copy, which blocks that thread only). When a copy fails, the chain
// stops, issues `on_error` (best effort: the writes that release the kernels waiting on it) and keeps
// the CUDA error's text.
class CopyChain {
 public:
  CopyChain(std::vector<CopyOp> ops, std::vector<CopyOp> on_error, std::uintptr_t stream, int device);
  ~CopyChain();  // joins the thread
  CopyChain(const CopyChain&) = delete;
  CopyChain& operator=(const CopyChain&) = delete;

  bool done() const { return done_.load(std::memory_order_acquire); }  // every copy issued (or the chain failed)
  void wait();                                                           // until done(); joins the thread
  std::string error() const;                                             // "" unless a copy failed (after done())
  std::size_t issued() const { return issued_.load(std::memory_order_acquire); }

 private:
  void run();

  std::vector<CopyOp> ops_, on_error_;
  std::uintptr_t stream_;
  int device_;
  std::string error_;
  std::atomic<bool> done_{false};
  std::atomic<std::size_t> issued_{0};
  std::thread thread_;
};

}  // namespace lorad
