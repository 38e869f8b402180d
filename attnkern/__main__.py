"""python -m attnkern: the attnkern command (attnkern_bench.cli)."""

from attnkern_bench.cli import main

raise SystemExit(main())
