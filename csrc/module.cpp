// The Python module `slimfit._C`. The kernels register themselves with the dispatcher
// (TORCH_LIBRARY_IMPL in csrc/cpu/*.cpp) when the shared library is loaded, which
// slimfit/_native.py does with torch.ops.load_library; the schemas are defined in
// Python (slimfit/kernels/_ops.py). This init only makes `import slimfit._C` work.
#include <Python.h>

namespace {

PyModuleDef slimfit_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Native (C++) kernels of slimfit, registered as torch.ops.slimfit.* for CPU tensors.",
    -1,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&slimfit_c_module); }
