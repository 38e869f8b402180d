"""attnkern kernels: the registry as a table or JSON (measures nothing)."""

from __future__ import annotations

import argparse
import json

import attnkern

HELP = "list every kernel, whether it runs here and its tunables"
DESCRIPTION = """\
Lists attnkern's kernels (attnkern.kernels()) with kernel_info(): whether each
runs on this machine (and why not), the features it takes (grouped k/v heads,
bottom-right causal, windows, key lengths, softcap), and its tunables with
defaults and ranges. Measures nothing."""


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern kernels`."""
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def command(args) -> int:
    infos = [attnkern.kernel_info(name) for name in attnkern.kernels()]
    if args.json:
        print(json.dumps(infos, indent=2))
        return 0
    print(f"# native ISA: {attnkern.active_isa()} (this CPU and build: {', '.join(attnkern.supported_isas())})")
    for info in infos:
        state = "available" if info["available"] else f"unavailable: {info['reason']}"
        extras = [x for x, on in (("lse", info["returns_lse"]), ("backward", info["backward"])) if on]
        print(f"{info['name']:<14} {info['device']:<5} {state}" + (f" [{', '.join(extras)}]" if extras else ""))
        print(f"{'':<14} {info['description']}")
        if info["features"]:  # docs/features.md
            backward = "" if info["backward_features"] in ([], info["features"]) else (
                f"; backward: {', '.join(info['backward_features'])}")
            limited = "".join(f"; {f} only in {', '.join(d)}" for f, d in info["feature_dtypes"].items())
            print(f"{'':<14}   features: {', '.join(info['features'])}{backward}{limited}")
        for pname, p in info["params"].items():
            allowed = ", ".join(map(str, p["choices"])) if "choices" in p else f"{p['min']}..{p['max']}"
            print(f"{'':<14}   {pname}={p['default']} ({allowed}): {p['doc']}")
    return 0
