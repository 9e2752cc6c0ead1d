"""Builds the native extension `slimfit._C` from csrc/.

The C++ CPU kernels are always compiled. The CUDA sources in csrc/cuda/ are
compiled only when torch is a CUDA build and nvcc is found. Environment:

  SLIMFIT_SKIP_NATIVE=1      build no extension at all (pure Python; reference kernels serve)
  SLIMFIT_SKIP_CUDA=1        build only the CPU part even when CUDA is available
  TORCH_CUDA_ARCH_LIST=9.0   GPU archs of the CUDA part (default 9.0 when no GPU is visible)
  MAX_JOBS=N                 parallel compile jobs (ninja)

Build without isolation so that the extension compiles against the torch that
is installed: `pip install --no-build-isolation -e .`
"""
import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvidia_pip_include_dirs() -> list[str]:
    """Headers of the pip `nvidia-*` packages: a CUDA build of torch needs them when the
    system toolkit holds only nvcc and cudart."""
    dirs = []
    for entry in sys.path:
        dirs += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "include")))
    return dirs


def _find_cuda_home() -> str | None:
    """torch guesses CUDA_HOME from `which nvcc`, which is wrong when nvcc is a wrapper in
    /usr/local/bin; prefer an explicit CUDA_HOME, then the real path of nvcc."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    real = os.path.realpath(nvcc)
    home = os.path.dirname(os.path.dirname(real))
    if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")) or home.startswith("/usr/local/cuda"):
        return home
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else home


def _extensions():
    if _flag("SLIMFIT_SKIP_NATIVE"):
        print("slimfit: SLIMFIT_SKIP_NATIVE is set; building no native extension")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit(
            "slimfit: building the native extension needs torch installed first, and the build "
            "must see it: `pip install torch` then `pip install --no-build-isolation .` "
            "(or set SLIMFIT_SKIP_NATIVE=1 for a pure-Python install)."
        )

    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))

    use_cuda = False
    if cuda_sources and torch.version.cuda is not None and not _flag("SLIMFIT_SKIP_CUDA"):
        cuda_home = _find_cuda_home()
        if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = cuda_home
            cpp_extension.CUDA_HOME = cuda_home
            use_cuda = True
        else:
            print("slimfit: torch is a CUDA build but no nvcc was found (set CUDA_HOME); building the CPU part only")

    if use_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        print(f"slimfit: compiling CUDA sources for TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(visible GPUs)')}")
        ext = cpp_extension.CUDAExtension(
            "slimfit._C",
            sources + cuda_sources,
            include_dirs=_nvidia_pip_include_dirs(),
            define_macros=[("SLIMFIT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--fmad=false"]},
        )
    else:
        ext = cpp_extension.CppExtension("slimfit._C", sources, extra_compile_args={"cxx": cxx_flags})
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
