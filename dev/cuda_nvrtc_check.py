"""Compile cuda.flash's CUDA C++ kernels here with NVRTC, as numba-cuda compiles them on the
device (NVRTC's JIT mode, -rdc, numba-cuda's include folders), without a GPU: nvcc
(dev/cuda_ptxas.py, dev/cuda_compile_check.sh) accepts code that NVRTC refuses, e.g. a generic
lambda, whose templated call operator NVRTC's JIT mode takes for a host function.

    LD_LIBRARY_PATH=<folder of libnvrtc.so.13> python dev/cuda_nvrtc_check.py [--only SUBSTRING]

The kernels and their constants are dev/cuda_ptxas.py's (KERNELS, source()); cuda.bindings
(numba-cuda's dependency) calls NVRTC; `pip install nvidia-cuda-nvrtc` gives a libnvrtc.so. Prints
ok or FAIL and NVRTC's log's tail per kernel; exits 1 if any failed."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import cuda_ptxas  # noqa: E402
from cuda.bindings import nvrtc  # noqa: E402


def includes() -> list:
    """numba-cuda's include folders for NVRTC 13 (as numba.cuda.cudadrv.nvrtc passes them), and CUDA's."""
    import numba_cuda

    base = os.path.join(os.path.dirname(numba_cuda.__file__), "numba", "cuda")
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0")
    return [os.path.join(base, "include", "13"), os.path.join(cuda, "include"), os.path.join(base, "memory_management")]


def compile_one(text: str, name: str, arch: str) -> tuple:
    """(ok, log) of NVRTC on one source."""
    _, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    opts = [f"-arch={arch}".encode(), b"-rdc=true"] + [f"-I{i}".encode() for i in includes()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    return res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="a substring of the kernels' names (cuda_ptxas.KERNELS)")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    failed = 0
    for path, name, defines, params in cuda_ptxas.KERNELS:
        if a.only in name:
            ok, log = compile_one(cuda_ptxas.source(path, name, defines, params), name, a.arch)
            errors = [line for line in log.splitlines() if "error" in line]
            print(("ok   " if ok else "FAIL ") + name + ("" if ok else "\n" + "\n".join(errors[-8:] or [log[-800:]])),
                  flush=True)
            failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
