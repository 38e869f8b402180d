"""The attnkern command: measurements of attnkern's kernels on this machine.

    attnkern bench                      CPU kernels side by side with torch and NumPy
    attnkern bench --device cuda        GPU kernels side by side with torch and CuPy
    attnkern features                   native.flash's features (GQA, masks, windows...) against torch's SDPA
    attnkern kernels                    every kernel, whether it runs here, its tunables
    attnkern tune                       search a kernel's block sizes and threads, cached for attention()
    attnkern roofline                   this machine's compute and memory ceilings, each kernel against them
    attnkern study                      forward and backward time and memory of attention training
    attnkern report                     a two-page PDF and an HTML page of the results above
    attnkern ring                       ring attention over W processes: memory, overlap, balance
    attnkern transfer --device cuda     GPU copies from pageable and pinned memory; cuda.flash on NumPy arrays
    attnkern profile --device cuda      hardware counters of each GPU kernel launch (ncu), beside the byte model

`attnkern <command> --help` says what each measures and how.
"""

from __future__ import annotations

import argparse
import sys

import attnkern

from . import bench, features, kernels, profile, report, ring, roofline, study, transfer, tuner

# each subcommand's module: HELP, DESCRIPTION, configure(parser) and command(args) -> exit status
COMMANDS = {"bench": bench, "features": features, "kernels": kernels, "tune": tuner, "roofline": roofline,
            "report": report, "study": study, "ring": ring, "transfer": transfer,
            "profile": profile}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnkern", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"attnkern {attnkern.__version__}")
    sub = p.add_subparsers(dest="command", metavar="command", required=True)
    for name, module in COMMANDS.items():
        child = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(child)
        child.set_defaults(func=module.command)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `attnkern ... | head`: the reader has gone; say nothing more
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
