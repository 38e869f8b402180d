"""matplotlib for the plots of every subcommand: on the Agg backend (files, no
display), or a clear exit naming the extra that installs it."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot with the Agg backend selected."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'attnkern[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
