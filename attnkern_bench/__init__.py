"""attnkern_bench: measuring attnkern, installed beside it.

The library (attnkern) holds what a user imports; this package holds how it is
measured, with one module per shared primitive that every measuring tool and
the tests use:

    timing    clocks (wall clock, CUDA events) and turn-taking with warm-up
    counts    FLOPs and bytes of one attention forward
    ceilings  the float32 matmul ceiling of the CPU (NumPy) and GPU (torch)
    inputs    seeded random q, k, v
    accuracy  the error bound against the float64 reference
    memory    peak memory of one call, in a fresh process
    machine   the CPU's name and thread pinning
    harness   check every kernel against the reference, then time them side by side
    features  native.flash's attention features against torch, and the window study
    cli       the `attnkern` command (also `python -m attnkern`)

It uses attnkern's public API only. The asv suite (benchmarks/) keeps its own
small copies of some of these, since it must run against commits older than
this package.
"""
