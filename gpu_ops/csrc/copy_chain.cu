// CopyChain (copy_chain.h): host->device copies issued by a native thread, never by the interpreter.
#include "copy_chain.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>

namespace lorad {

CopyChain::CopyChain(std::vector<CopyOp> ops, std::vector<CopyOp> on_error, std::uintptr_t stream, int device)
    : ops_(std::move(ops)), on_error_(std::move(on_error)), stream_(stream), device_(device) {
  thread_ = std::thread(&CopyChain::run, this);
}

CopyChain::~CopyChain() {
  if (thread_.joinable()) thread_.join();
}

void CopyChain::wait() {
  if (thread_.joinable()) thread_.join();
}

std::string CopyChain::error() const {
  return done() ? error_ : std::string();
}

void CopyChain::run() {
  auto stream = reinterpret_cast<cudaStream_t>(stream_);
  cudaError_t status = cudaSetDevice(device_);
  std::size_t index = 0;
  if (status == cudaSuccess) {
    for (; index < ops_.size(); ++index) {
      const CopyOp& op = ops_[index];
      status = cudaMemcpyAsync(reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src), op.nbytes,
                               cudaMemcpyHostToDevice, stream);
      if (status != cudaSuccess) break;
      issued_.store(index + 1, std::memory_order_release);
    }
  }
  if (status != cudaSuccess) {
    error_ = std::string("copy ") + std::to_string(index) + " of " + std::to_string(ops_.size()) + ": " +
             cudaGetErrorName(status) + ": " + cudaGetErrorString(status);
    cudaGetLastError();  // a non-sticky error must not fail the next call of this thread
    for (const CopyOp& op : on_error_) {
      cudaMemcpyAsync(reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src), op.nbytes,
                      cudaMemcpyHostToDevice, stream);
    }
  }
  done_.store(true, std::memory_order_release);
}

}  // namespace lorad
