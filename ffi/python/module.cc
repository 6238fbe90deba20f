// A tiny CPython extension exposing the FFI handlers of one platform as PyCapsules.
//
// Built twice, as nvfp4_jax._nvfp4_cpu and nvfp4_jax._nvfp4_cuda: NVFP4_MODULE names the
// module and NVFP4_SUFFIX the handler symbols (NvFp4AmaxCpu, ...). A real extension
// module is importable through scikit-build-core's editable redirect hook, which a bare
// shared library next to __file__ is not. Raw C API: no binding library to depend on.
// The CPU module also has set_isa() (tests), the CUDA module probe() (checked at load).
#include <Python.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/c_api.h"

#define NVFP4_CAT2(a, b) a##b
#define NVFP4_CAT(a, b) NVFP4_CAT2(a, b)
#define NVFP4_STR2(a) #a
#define NVFP4_STR(a) NVFP4_STR2(a)
#define NVFP4_HANDLER(name) NVFP4_CAT(name, NVFP4_SUFFIX)

extern "C" {
XLA_FFI_Error* NVFP4_HANDLER(NvFp4Amax)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4Quantize)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4FakeQuantize)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4Quantize4over6)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4FakeQuantize4over6)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4Dequantize)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4Rht)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4AmaxMsEden)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4QuantizeMsEden)(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* NVFP4_HANDLER(NvFp4FakeQuantizeMsEden)(XLA_FFI_CallFrame* call_frame);
#if defined(NVFP4_CPU_VARIANTS)
XLA_FFI_Error* NvFp4GemmCpu(XLA_FFI_CallFrame* call_frame);  // CPU only
XLA_FFI_Error* NvFp4W4a16Cpu(XLA_FFI_CallFrame* call_frame);  // CPU only
XLA_FFI_Error* NvFp4GroupedQuantizeCpu(XLA_FFI_CallFrame* call_frame);  // CPU only
XLA_FFI_Error* NvFp4Threefry2x32Cpu(XLA_FFI_CallFrame* call_frame);  // CPU only
XLA_FFI_Error* NvFp4KvCacheWriteCpu(XLA_FFI_CallFrame* call_frame);  // CPU only
XLA_FFI_Error* NvFp4KvCacheReadCpu(XLA_FFI_CallFrame* call_frame);   // CPU only
XLA_FFI_Error* NvFp4KvAttentionCpu(XLA_FFI_CallFrame* call_frame);   // CPU only
#endif
}

#if defined(NVFP4_CPU_VARIANTS)
namespace nvfp4::cpu {
bool ForceTable(const char* isa);
const char* CurrentIsa();
void SetGemmMaxThreads(int64_t n);
bool SetGemmAmx(bool allowed);
}
#endif

#if defined(NVFP4_CUDA_PROBE)
// cuda/handlers.cu: why no kernel can run on the current CUDA device ("" when one can).
extern "C" void NvFp4CudaProbe(char* buf, size_t size);
#endif

namespace {

struct Target {
  const char* name;
  void* handler;
};

// The targets both platforms have (cpu/handlers.cc and cuda/handlers.cu, MS-EDEN in
// cpu/ms_eden.cc and cuda/ms_eden.cu), then those only the CPU has. These names are the
// only list of targets: nvfp4_jax/_src/core/kernels/_library.py registers what
// registrations() returns and takes TARGETS and CPU_TARGETS from shared_targets().
const Target kSharedTargets[] = {
    {"nvfp4_amax", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4Amax))},
    {"nvfp4_quantize", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4Quantize))},
    {"nvfp4_fake_quantize", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4FakeQuantize))},
    {"nvfp4_dequantize", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4Dequantize))},
    {"nvfp4_rht", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4Rht))},
    {"nvfp4_quantize_4over6", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4Quantize4over6))},
    {"nvfp4_fake_quantize_4over6",
     reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4FakeQuantize4over6))},
    {"nvfp4_amax_ms_eden", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4AmaxMsEden))},
    {"nvfp4_quantize_ms_eden", reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4QuantizeMsEden))},
    {"nvfp4_fake_quantize_ms_eden",
     reinterpret_cast<void*>(NVFP4_HANDLER(NvFp4FakeQuantizeMsEden))},
};

#if defined(NVFP4_CPU_VARIANTS)
const Target kPlatformTargets[] = {
    {"nvfp4_gemm", reinterpret_cast<void*>(NvFp4GemmCpu)},
    {"nvfp4_w4a16", reinterpret_cast<void*>(NvFp4W4a16Cpu)},
    {"nvfp4_grouped_quantize", reinterpret_cast<void*>(NvFp4GroupedQuantizeCpu)},
    {"nvfp4_threefry2x32", reinterpret_cast<void*>(NvFp4Threefry2x32Cpu)},
    {"nvfp4_kv_cache_write", reinterpret_cast<void*>(NvFp4KvCacheWriteCpu)},
    {"nvfp4_kv_cache_read", reinterpret_cast<void*>(NvFp4KvCacheReadCpu)},
    {"nvfp4_kv_attention", reinterpret_cast<void*>(NvFp4KvAttentionCpu)},
};
constexpr size_t kPlatformCount = sizeof(kPlatformTargets) / sizeof(Target);
#else
const Target* const kPlatformTargets = nullptr;  // CUDA: none of its own
constexpr size_t kPlatformCount = 0;
#endif
constexpr size_t kSharedCount = sizeof(kSharedTargets) / sizeof(Target);

// Adds {name: PyCapsule} of `n` targets to `dict`; false (with a Python error) on failure.
bool AddCapsules(PyObject* dict, const Target* targets, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    PyObject* capsule = PyCapsule_New(targets[i].handler, nullptr, nullptr);
    if (capsule == nullptr || PyDict_SetItemString(dict, targets[i].name, capsule) != 0) {
      Py_XDECREF(capsule);
      return false;
    }
    Py_DECREF(capsule);
  }
  return true;
}

// registrations() -> {target name: PyCapsule of the XLA FFI handler}.
PyObject* Registrations(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (dict == nullptr) return nullptr;
  if (!AddCapsules(dict, kSharedTargets, kSharedCount) ||
      !AddCapsules(dict, kPlatformTargets, kPlatformCount)) {
    Py_DECREF(dict);
    return nullptr;
  }
  return dict;
}

// shared_targets() -> tuple of the names of the targets both platforms have, in order.
PyObject* SharedTargets(PyObject*, PyObject*) {
  const size_t n = kSharedCount;
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < n; ++i) {
    PyObject* name = PyUnicode_FromString(kSharedTargets[i].name);
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), name);
  }
  return names;
}

#if defined(NVFP4_CPU_VARIANTS)
// set_isa(name) -> bool: run the CPU kernels built for `name` ("" for the best); for tests.
PyObject* SetIsa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  return PyBool_FromLong(nvfp4::cpu::ForceTable(name));
}
#endif

#if defined(NVFP4_CPU_VARIANTS)
// isa() -> str: the x86 level whose CPU kernels run now ("baseline", "x86-64-v3", "x86-64-v4").
PyObject* Isa(PyObject*, PyObject*) { return PyUnicode_FromString(nvfp4::cpu::CurrentIsa()); }
#endif

#if defined(NVFP4_CPU_VARIANTS)
// set_gemm_threads(n) -> None: run the GEMM on at most n threads (0: all); for tests.
PyObject* SetGemmThreads(PyObject*, PyObject* arg) {
  const long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  nvfp4::cpu::SetGemmMaxThreads(n);
  Py_RETURN_NONE;
}
#endif

#if defined(NVFP4_CPU_VARIANTS)
// set_gemm_amx(flag) -> bool: allow AMX-INT8 in nvfp4_gemm or not (the default); returns
// whether the GEMM now runs it (the CPU has it, the kernel granted it, the x86-64-v4 kernels
// run). For tests and benchmarks.
PyObject* SetGemmAmx(PyObject*, PyObject* arg) {
  const int flag = PyObject_IsTrue(arg);
  if (flag < 0) return nullptr;
  return PyBool_FromLong(nvfp4::cpu::SetGemmAmx(flag != 0));
}
#endif

#if defined(NVFP4_CUDA_PROBE)
// probe() -> str: "" when this module's kernels can run on the current CUDA device, else why
// not (no driver or device, driver too old, no kernel image for its compute capability).
PyObject* Probe(PyObject*, PyObject*) {
  char reason[1024];
  Py_BEGIN_ALLOW_THREADS NvFp4CudaProbe(reason, sizeof(reason));
  Py_END_ALLOW_THREADS return PyUnicode_DecodeUTF8(reason, static_cast<Py_ssize_t>(strlen(reason)),
                                                   "replace");
}
#endif

PyMethodDef kMethods[] = {
    {"registrations", Registrations, METH_NOARGS,
     "Returns {target name: PyCapsule} of this platform's XLA FFI handlers."},
    {"shared_targets", SharedTargets, METH_NOARGS,
     "Returns the names of the targets both platforms have (the others are this one's own)."},
#if defined(NVFP4_CPU_VARIANTS)
    {"set_isa", SetIsa, METH_O,
     "Uses the CPU kernels built for an x86 level ('baseline', 'x86-64-v3', 'x86-64-v4'), "
     "or the best one for ''. Returns False if this CPU cannot run it. For tests."},
    {"isa", Isa, METH_NOARGS,
     "Returns the x86 level whose CPU kernels run now: 'baseline', 'x86-64-v3' or 'x86-64-v4'."},
    {"set_gemm_threads", SetGemmThreads, METH_O,
     "Runs nvfp4_gemm on at most n threads (0: all the pool has). For tests."},
    {"set_gemm_amx", SetGemmAmx, METH_O,
     "Allows AMX-INT8 in nvfp4_gemm (True) or not (False, the default); returns whether it runs. "
     "For tests and benchmarks."},
#endif
#if defined(NVFP4_CUDA_PROBE)
    {"probe", Probe, METH_NOARGS,
     "Returns '' when these CUDA kernels can run on the current device, else the reason "
     "(no device, driver too old, no kernel image for the device's compute capability)."},
#endif
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    NVFP4_STR(NVFP4_MODULE),           // m_name
    "nvfp4_jax native FFI handlers.",  // m_doc
    -1,                                // m_size: no per-module state
    kMethods,                          // m_methods
    nullptr,                           // m_slots
    nullptr,                           // m_traverse
    nullptr,                           // m_clear
    nullptr,                           // m_free
};

}  // namespace

PyMODINIT_FUNC NVFP4_CAT(PyInit_, NVFP4_MODULE)(void) { return PyModule_Create(&kModule); }
