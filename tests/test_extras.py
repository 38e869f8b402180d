"""Every optional dependency missing at call time gives an error that names the
extra installing it (pip install 'attnkern[extra]'). A missing module is
simulated by sys.modules[name] = None, which makes `import name` fail and
importlib.util.find_spec(name) return None."""

import sys

import numpy as np
import pytest

import attnkern
from attnkern.backends import cuda as cuda_backend
from attnkern.backends import triton as triton_backend


@pytest.fixture
def missing(monkeypatch):
    """missing(name, ...): those modules (and their submodules) cannot be imported."""
    def hide(*names):
        for name in names:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, loaded)
            monkeypatch.setitem(sys.modules, name, None)

    return hide


@pytest.fixture
def fresh_availability():
    """The GPU backends cache whether they can run; asked again, and again after the test."""
    for cached in (cuda_backend.unavailable, triton_backend._unavailable):
        cached.cache_clear()
    yield
    for cached in (cuda_backend.unavailable, triton_backend._unavailable):
        cached.cache_clear()


Q = np.ones((1, 8, 4), np.float32)


def test_tune_without_optuna_names_the_tune_extra(missing):
    missing("optuna")
    with pytest.raises(ModuleNotFoundError, match=r"needs optuna.*pip install 'attnkern\[tune\]'"):
        attnkern.tune((1, 1, 32, 8), cache=False, budget=1, repeats=2)


@pytest.mark.parametrize("kernel, extra", [("torch.sdpa", "torch"), ("torch.naive", "torch"),
                                           ("numba.flash", "numba")])
def test_cpu_kernels_without_their_package_name_the_extra(missing, kernel, extra):
    missing(extra)
    assert f"pip install 'attnkern[{extra}]'" in attnkern.kernel_info(kernel)["reason"]
    with pytest.raises(RuntimeError, match=rf"not available here: .*pip install 'attnkern\[{extra}\]'"):
        attnkern.attention(Q, Q, Q, kernel=kernel)


@pytest.mark.parametrize("kernel, module, extra", [("cuda.flash", "numba_cuda", "cuda"),
                                                   ("cuda.naive", "numba_cuda", "cuda"),
                                                   ("triton.flash", "triton", "triton")])
def test_gpu_kernels_without_their_package_name_the_extra(missing, fresh_availability, kernel, module, extra):
    missing(module)
    with pytest.raises(RuntimeError, match=rf"not available here: .*pip install 'attnkern\[{extra}\]'"):
        attnkern.attention(Q, Q, Q, kernel=kernel)


def test_a_refusal_lists_every_kernel(missing):
    missing("torch")
    with pytest.raises(RuntimeError) as err:
        attnkern.attention(Q, Q, Q, kernel="torch.sdpa")
    listed = str(err.value).split("every kernel for this call")[1]
    assert all(f"  {name}: " in listed for name in attnkern.kernels())
    assert "  native.flash: runs it" in listed


class ForeignGpuArray:
    """A GPU array of some other library: only __cuda_array_interface__."""

    __cuda_array_interface__ = {"shape": (1, 8, 4), "typestr": "<f4", "data": (0, False), "version": 3,
                                "strides": None}


def test_foreign_gpu_arrays_without_numba_cuda_name_the_cuda_extra(missing):
    missing("numba")
    x = ForeignGpuArray()
    with pytest.raises(TypeError, match=r"need numba-cuda.*pip install 'attnkern\[cuda\]'"):
        attnkern.attention(x, x, x)


def test_bfloat16_tensors_without_ml_dtypes_name_the_bfloat16_extra(missing):
    torch = pytest.importorskip("torch")
    q = torch.ones(8, 4, dtype=torch.bfloat16)
    missing("ml_dtypes")
    with pytest.raises(TypeError, match=r"pip install 'attnkern\[bfloat16\]'"):
        attnkern.attention(q, q, q)


def test_distributed_without_torch_names_the_torch_extra(missing):
    from attnkern import distributed

    missing("torch")
    with pytest.raises(ModuleNotFoundError, match=r"attnkern.distributed needs torch.*'attnkern\[torch\]'"):
        distributed.init_from_env()
    with pytest.raises(ModuleNotFoundError, match=r"'attnkern\[torch\]'"):
        distributed.launch(print, 1)
    with pytest.raises(ModuleNotFoundError, match=r"'attnkern\[torch\]'"):
        distributed.ring_attention(Q, Q, Q)
    with pytest.raises(ModuleNotFoundError, match=r"'attnkern\[torch\]'"):
        distributed.shard(Q)


def test_plots_without_matplotlib_name_the_bench_extra(missing):
    from attnkern_bench.plotting import pyplot

    missing("matplotlib")
    with pytest.raises(SystemExit, match=r"pip install 'attnkern\[bench\]'"):
        pyplot()
