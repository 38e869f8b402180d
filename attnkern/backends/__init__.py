"""The kernels, one module or package per backend, named as the registry names
them: numpy.*, native.*, torch.*, numba.*, cuda.*, triton.*. Importing a backend
registers its kernels; none imports its optional dependency (torch, Numba,
numba-cuda, Triton) before a kernel of it runs."""

from . import native, numpy, torch, numba, cuda, triton  # noqa: F401, I001  (registers the kernels, in this order)
