"""attnkern's version: one place, below every module that reports it."""

__version__ = "0.1.0"
