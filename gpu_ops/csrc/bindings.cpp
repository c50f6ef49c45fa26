// Python bindings of lorad.gpu_ops._lorad_cuda: raw addresses and sizes in, nothing out (no torch
// headers, no libtorch). Importing the module touches no CUDA API, so it imports on machines without
// a GPU or driver; the first call there raises RuntimeError with the CUDA runtime's message.
// gpu_ops/cuda_ext.py wraps these with checks on torch tensors.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "host_signal.h"

namespace py = pybind11;

PYBIND11_MODULE(_lorad_cuda, m) {
  m.doc() = "lorad's CUDA ops: sync-free CPU LoRA invocation (fused async copy + signal, GPU-side wait + add), page runs copied in one call";
  m.attr("DTYPE_FLOAT32") = static_cast<int>(lorad::kFloat32);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(lorad::kFloat16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(lorad::kBFloat16);
  m.attr("MAX_FLAG_SEQS") = lorad::kMaxFlagSeqs;

  m.def("device_count", &lorad::device_count, "Number of CUDA devices; RuntimeError when none can be used.");
  m.def("runtime_version", &lorad::runtime_version, "CUDA runtime version this module was linked with (13000 = 13.0).");
  m.def("register_host", &lorad::register_host, py::arg("host_ptr"), py::arg("nbytes"),
        "cudaHostRegister(portable | mapped): pin a host region (an mmap of shared memory) and map it for the GPU.");
  m.def("unregister_host", &lorad::unregister_host, py::arg("host_ptr"), "cudaHostUnregister.");
  m.def("device_pointer", &lorad::device_pointer, py::arg("host_ptr"),
        "cudaHostGetDevicePointer: the device address of a registered host address.");
  m.def("copy_and_signal", &lorad::copy_and_signal, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("flag"),
        py::arg("seq"), py::arg("stream"), py::arg("num_flags") = 1, py::arg("flag_stride") = 8,
        py::arg("seqs") = std::vector<std::int64_t>{},
        "One kernel on `stream`: copy nbytes device memory src -> mapped host memory dst (device addresses), "
        "then store int64 seq into num_flags flags flag_stride bytes apart (flag f: seqs[f] when seqs is given). "
        "Returns at once.");
  m.def("wait_and_add", &lorad::wait_and_add, py::arg("out"), py::arg("result"), py::arg("nrows"), py::arg("ncols"),
        py::arg("out_row_stride"), py::arg("result_row_stride"), py::arg("dtype_code"), py::arg("flag"), py::arg("seq"),
        py::arg("stream"), py::arg("timeout_ns"), py::arg("error"), py::arg("num_flags") = 1, py::arg("flag_stride") = 8,
        py::arg("skip_if_error") = false, py::arg("seqs") = std::vector<std::int64_t>{},
        "One kernel on `stream`: wait on the GPU until every flag >= seq (flag f: seqs[f] when seqs is given), then out[r, c] += result[r, c] (fp32 result "
        "in mapped host memory; strides in elements). After timeout_ns: add nothing, store the missed seq into the "
        "int64 error word if it is 0. skip_if_error: give up at once when the error word is already non-zero. Returns at once.");
  m.def("copy_rows", &lorad::copy_rows, py::arg("device"), py::arg("dst"), py::arg("src"), py::arg("row_bytes"),
        py::arg("runs"), py::arg("num_runs"), py::arg("tail_dst"), py::arg("tail_src"), py::arg("tail_bytes"),
        py::arg("stream"),
        "One cudaMemcpyAsync on `stream` per int64 triple (src_row, dst_row, rows) at host address `runs` (rows of "
        "row_bytes bytes, unified addresses), then tail_bytes from tail_src to tail_dst when tail_bytes > 0. "
        "Returns at once (a pageable source: once the driver has staged it).");
}
