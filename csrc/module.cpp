// The Python module `slimfit._C`. The kernels register themselves with the dispatcher
// (TORCH_LIBRARY_IMPL in csrc/cpu/*.cpp) when the shared library is loaded, which
// slimfit/_native.py does with torch.ops.load_library; the schemas are defined in
// Python (slimfit/kernels/_ops.py). Besides making `import slimfit._C` work, the module
// has one build check: how many threads the kernels' at::parallel_for really uses.
#include <ATen/Parallel.h>
#include <Python.h>

#include <atomic>
#include <cstdint>

namespace {

// Threads that took part in a parallel_for over a large range (at most 64 counted). Less
// than at::get_num_threads() means the extension was compiled without the parallel
// backend torch uses (e.g. OpenMP's -fopenmp missing): every CPU kernel then runs serially.
PyObject* cpu_threads_used(PyObject*, PyObject*) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, int64_t(1) << 16, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < 64) seen.fetch_or(uint64_t(1) << t);
  });
  long count = 0;
  for (uint64_t m = seen.load(); m; m &= m - 1) ++count;
  return PyLong_FromLong(count);
}

PyMethodDef slimfit_c_methods[] = {
    {"cpu_threads_used", cpu_threads_used, METH_NOARGS,
     "Threads one at::parallel_for of the CPU kernels used (a build check)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef slimfit_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Native (C++) kernels of slimfit, registered as torch.ops.slimfit.* for CPU tensors.",
    -1,
    slimfit_c_methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&slimfit_c_module); }
