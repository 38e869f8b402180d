"""Optional dependencies, imported at call time: a missing one raises an error
that names the extra of attnkern that brings it (pip install 'attnkern[extra]'),
rather than Python's bare ModuleNotFoundError."""

from __future__ import annotations

import importlib


def require(module: str, extra: str, what: str):
    """Imports and returns `module`, or raises ModuleNotFoundError saying that
    `what` needs it and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        raise ModuleNotFoundError(f"{what} needs {top}, which is not installed ({exc}): "
                                  f"pip install 'attnkern[{extra}]'", name=top) from None
