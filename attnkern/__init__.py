"""attnkern: scaled-dot-product attention kernels, softmax(Q K^T * scale) V.

    out = attnkern.attention(q, k, v, causal=False, scale=None, kernel="auto", **params)
    attnkern.reference(q, k, v)   # float64 NumPy oracle
    attnkern.kernels()            # every kernel name
    attnkern.kernel_info(name)    # available here? tunables?
"""

from . import backends  # noqa: F401  (registers the kernels)
from ._api import attention
from ._reference import reference
from ._registry import kernel_info, kernels
from .backends.native import active_isa, supported_isas

__all__ = ["attention", "reference", "kernels", "kernel_info", "active_isa", "supported_isas"]
__version__ = "0.1.0"
