"""Builds the native extension `slimfit._C` from csrc/.

The C++ CPU kernels are always compiled. The CUDA sources in csrc/cuda/ are
compiled only when torch is a CUDA build and nvcc is found. Environment:

  SLIMFIT_SKIP_NATIVE=1      build no extension at all (pure Python; reference kernels serve)
  SLIMFIT_SKIP_CUDA=1        build only the CPU part even when CUDA is available
  TORCH_CUDA_ARCH_LIST=9.0   GPU archs of the CUDA part (default 9.0 when no GPU is visible);
                             PTX is added for the newest one listed ("9.0" -> "9.0+PTX")
  CUDA_HOME=/usr/local/cuda  the CUDA toolkit (default: the one nvcc on PATH reports)
  MAX_JOBS=N                 parallel compile jobs (ninja)
  SLIMFIT_NO_OPENMP=1        compile the CPU kernels without OpenMP (they then run on one thread)

Build without isolation so that the extension compiles against the torch that
is installed: `pip install --no-build-isolation -e .`
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvidia_pip_include_dirs() -> list[str]:
    """Headers of the pip `nvidia-*` packages (nvidia/cu13/include for CUDA 13 wheels,
    nvidia/<lib>/include for CUDA 12 ones). A CUDA build of torch pulls in cuBLAS/cuSPARSE/
    cuSOLVER headers (e.g. through ATen/cuda/CUDAContext.h) that a toolkit holding only nvcc
    and cudart lacks. They are passed with -isystem, i.e. searched after the toolkit's own
    include folder (-I), so nvcc always sees its own cuda_runtime.h and crt/ headers and the
    pip copies only fill the gaps."""
    dirs = []
    for entry in sys.path:
        for d in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "include"))):
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def _nvcc_install_root(nvcc: str) -> str | None:
    """The toolkit folder of an nvcc, asked of nvcc itself: `nvcc --dryrun` prints
    `TOP=<root>/bin/..`. Works through wrapper scripts, which realpath cannot see through."""
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    if not m:
        return None
    root = os.path.realpath(m.group(1).strip().strip('"'))
    return root if os.path.exists(os.path.join(root, "bin", "nvcc")) else None


def _find_cuda_home() -> str | None:
    """torch guesses CUDA_HOME as dirname(dirname(`which nvcc`)), which gives /usr/local when
    nvcc is a wrapper script in /usr/local/bin. Prefer an explicit CUDA_HOME (or CUDA_PATH),
    then the toolkit that nvcc on PATH reports as its own, then /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        real = os.path.realpath(nvcc)  # a symlink into the toolkit resolves here
        home = os.path.dirname(os.path.dirname(real))
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
        root = _nvcc_install_root(nvcc)  # a wrapper script: ask nvcc
        if root is not None:
            return root
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST with PTX for the newest arch (forward compatibility with GPUs
    newer than any listed): "8.0;9.0" -> "8.0;9.0+PTX". Left as given when it already
    names +PTX, uses a named arch ("Hopper"), or is "native". Default 9.0+PTX."""
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not raw:
        return "9.0+PTX"
    archs = [a for a in re.split(r"[;\s]+", raw) if a]
    if "+PTX" in raw or raw == "native" or not all(re.fullmatch(r"\d+\.\d+[af]?", a) for a in archs):
        return raw

    def key(a: str) -> tuple[int, int]:
        major, minor = re.match(r"(\d+)\.(\d+)", a).groups()
        return int(major), int(minor)

    newest = max(range(len(archs)), key=lambda i: key(archs[i]))
    archs[newest] += "+PTX"
    return ";".join(archs)


def _openmp_flags(torch) -> list[str]:
    """-fopenmp when torch parallelises with OpenMP on Linux. at::parallel_for is a header
    template whose `#pragma omp parallel` compiles into the extension itself: without the
    flag every CPU kernel runs on one thread. The extension then needs libgomp.so.1, which
    resolves to the copy torch already loaded (same soname), so both share one thread pool
    and torch.set_num_threads governs both."""
    if not sys.platform.startswith("linux") or _flag("SLIMFIT_NO_OPENMP"):
        return []
    if not torch.backends.openmp.is_available():
        print("slimfit: torch is not built with OpenMP; the CPU kernels run on one thread")
        return []
    return ["-fopenmp"]


def _extensions():
    if _flag("SLIMFIT_SKIP_NATIVE"):
        print("slimfit: SLIMFIT_SKIP_NATIVE is set; building no native extension")
        return [], {}
    try:
        import torch
    except ImportError:
        sys.exit(
            "slimfit: building the native extension needs torch installed first, and the build "
            "must see it: `pip install torch` then `pip install --no-build-isolation .` "
            "(or set SLIMFIT_SKIP_NATIVE=1 for a pure-Python install)."
        )

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))

    # CUDA part: needs a CUDA build of torch, an nvcc, and the same CUDA major version on
    # both sides (torch's cpp_extension refuses a major mismatch; a minor one only warns).
    cuda_home = None
    if not cuda_sources or _flag("SLIMFIT_SKIP_CUDA"):
        pass
    elif torch.version.cuda is None:
        print(f"slimfit: torch {torch.__version__} is a CPU build; building the CPU part only")
    else:
        cuda_home = _find_cuda_home()
        if not (cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))):
            print(
                f"slimfit: torch {torch.__version__} is a CUDA {torch.version.cuda} build but no CUDA toolkit "
                "(nvcc) was found; set CUDA_HOME to build the CUDA kernels. Building the CPU part only."
            )
            cuda_home = None
        else:
            nvcc_ver = _nvcc_version(cuda_home)
            if nvcc_ver is not None and nvcc_ver.split(".")[0] != torch.version.cuda.split(".")[0]:
                print(
                    f"slimfit: nvcc {nvcc_ver} ({cuda_home}) and torch's CUDA {torch.version.cuda} differ in "
                    "major version, which torch does not support for extensions; install a toolkit of "
                    f"CUDA {torch.version.cuda.split('.')[0]}.x (CUDA_HOME=...) or the torch build for CUDA "
                    f"{nvcc_ver.split('.')[0]}. Building the CPU part only."
                )
                cuda_home = None
            else:
                print(f"slimfit: CUDA toolkit {cuda_home} (nvcc {nvcc_ver}), "
                      f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    if cuda_home is not None:
        # Before importing cpp_extension: it reads CUDA_HOME once, at import.
        os.environ["CUDA_HOME"] = cuda_home

    from torch.utils import cpp_extension

    # No -std here: torch's cpp_extension adds the standard its headers need (C++20 from
    # torch 2.10 on; an explicit -std=c++17 breaks the build against torch 2.14).
    openmp = _openmp_flags(torch)
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"] + openmp
    if cuda_home is not None:
        cpp_extension.CUDA_HOME = cuda_home  # in case cpp_extension was imported earlier
        if os.environ.get("TORCH_CUDA_ARCH_LIST") or not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list()
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "(visible GPUs)+PTX")
        print(f"slimfit: compiling CUDA sources for TORCH_CUDA_ARCH_LIST={arch_list}")
        pip_includes = []
        for d in _nvidia_pip_include_dirs():
            pip_includes += ["-isystem", d]
        nvcc_flags = [
            "-O3",
            "--fmad=false",  # the kernels must be bit-exact with the fp32 reference: no FMA contraction
            "-lineinfo",  # source lines in profiles (ncu); does not change the code
        ]
        ext = cpp_extension.CUDAExtension(
            "slimfit._C",
            sources + cuda_sources,
            define_macros=[("SLIMFIT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags + pip_includes, "nvcc": nvcc_flags + pip_includes},
            extra_link_args=openmp,
        )
    else:
        ext = cpp_extension.CppExtension("slimfit._C", sources, extra_compile_args={"cxx": cxx_flags},
                                         extra_link_args=openmp)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
