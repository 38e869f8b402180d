"""The AVX-512 counted signal: instructions that native.flash's AVX-512 code executes,
counted natively by compiler instrumentation (Valgrind, the gate's other counter,
emulates x86 only up to AVX2, so it runs the AVX2 path).

    .venv/bin/python tools/avx512_count.py --base main [--head HEAD] [--json out.json]
    .venv/bin/python tools/avx512_count.py --source-dir attnkern/backends/native   # one tree's counts

For each commit, attnkern/backends/native is taken out of git (`git archive`) into a
temporary directory and built with plain gcc, independent of meson, into one
executable: attn_avx512.c with meson's flags for it (-mavx512f -mavx2 -mfma -mf16c,
-O3, C11, OpenMP) plus GCC's -fsanitize-coverage=trace-pc, which starts each basic
block with a call to __sanitizer_cov_trace_pc; attn_dispatch.c (the C API, built with
the AVX-512 unit only) and attn_generic.c uninstrumented; and tools/avx512count/harness.c,
whose __sanitizer_cov_trace_pc counts the hits of each return address. The harness
calls attn_forward_f32 / attn_backward_f32 (flash, ISA avx512, 1 thread, block_q =
block_k = 256, scale 1/sqrt(D), seeded inputs) once uncounted and once counted, and
writes the hits per block.

Each block's weight is the instructions of the executable (`objdump -d`) from the
instruction after one __sanitizer_cov_trace_pc call up to the next such call in address
order, the calls themselves and nops (alignment padding) left out; a function's
instructions before its first call (the prologue) go to that first call's block. The
total, sum of hits x weight, is an approximation of the instructions executed in the
AVX-512 translation unit (docs/regression-gate.md says where it errs). It is
deterministic: the same sources, inputs and compiler give the same total.

A configuration is `slower` when HEAD's total exceeds BASE's by more than --threshold
(default 1%). Exit status 1 if any is slower, 0 otherwise (also when the signal is
skipped: no AVX-512 CPU, no gcc or objdump; the reason is printed), 2 on an error.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gate_table import GateError, print_table, resolve  # noqa: E402  (the gate's table and revisions)

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "avx512count" / "harness.c"
NATIVE = "attnkern/backends/native"
SHAPES = ["1x2x256x64", "1x2x333x64"]  # the gate's counted shapes (tools/gate.py COUNT_SHAPES)
PASSES = ["forward", "backward"]
# meson.build's flags of attn_avx512.c, and of a release build (buildtype=release, c_std=c11)
AVX512_FLAGS = ["-mavx512f", "-mavx2", "-mfma", "-mf16c"]
COMMON_FLAGS = ["-O3", "-std=c11", "-DNDEBUG", "-fopenmp", "-fno-pie", "-w"]
# attn_problem fields whose neutral value is not 0: the harness sets those the commit has
OPTIONAL_FIELDS = ["kv_group", "window_left", "heads", "mask_heads"]
HOOK = "__sanitizer_cov_trace_pc"


class CountError(Exception):
    """A build or a run failed: exit status 2."""


def missing() -> str | None:
    """None if the signal can run here, else why not."""
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    if not re.search(r"^flags\s*:.*\bavx512f\b", flags, re.M):
        return "this CPU has no AVX-512F (or /proc/cpuinfo is unreadable): the AVX-512 path cannot run here"
    for tool in ("gcc", "objdump"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH: the AVX-512 counting harness is built with gcc and read with objdump"
    return None


def config_key(kind: str, shape: str, causal: bool) -> str:
    """native.flash:SHAPE:CAUSAL (the forward, as the gate names it) or
    native.flash.backward:SHAPE:CAUSAL."""
    return f"native.flash{'' if kind == 'forward' else '.backward'}:{shape}:{int(causal)}"


def configs(shapes=SHAPES, passes=PASSES) -> list[tuple[str, str, bool]]:
    return [(kind, shape, causal) for kind in passes for shape in shapes for causal in (False, True)]


def export_sources(repo: Path, rev: str, dest: Path) -> Path:
    """attnkern/backends/native of commit `rev` written under `dest`; returns that directory."""
    proc = subprocess.run(["git", "archive", "--format=tar", rev, NATIVE], cwd=repo, capture_output=True)
    if proc.returncode != 0:
        raise CountError(f"git archive {rev} {NATIVE} failed: {proc.stderr.decode()[-500:]}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest / NATIVE


def build(src: Path, out: Path) -> Path:
    """The instrumented harness of the native sources in `src`, built in `out`."""
    src, out = Path(src).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header = (src / "attn.h").read_text()
    fields = [f"-DACNT_HAS_{f}" for f in OPTIONAL_FIELDS if re.search(rf"\b{f}\b", header)]
    # the C API of older commits (see harness.c)
    if re.search(r"attn_forward_f32\([^;]*\bfloat \*lse\)", header):
        fields.append("-DACNT_FORWARD_LSE")
    if re.search(r"\battn_backward_f32\(", header):
        fields.append("-DACNT_HAS_BACKWARD")
    if re.search(r"\battn_isa_reason\(", header):
        fields.append("-DACNT_HAS_ISA_REASON")
    base = ["gcc", *COMMON_FLAGS, f"-I{src}"]
    steps = [
        [*base, *AVX512_FLAGS, "-fsanitize-coverage=trace-pc", "-c", str(src / "attn_avx512.c"), "-o", "avx512.o"],
        [*base, "-c", str(src / "attn_generic.c"), "-o", "generic.o"],
        [*base, "-DATTN_HAVE_AVX512", "-DATTN_HAVE_OMP_PAUSE", "-c", str(src / "attn_dispatch.c"), "-o",
         "dispatch.o"],
        [*base, *fields, "-c", str(HARNESS), "-o", "harness.o"],
        ["gcc", "-fopenmp", "-no-pie", "harness.o", "dispatch.o", "avx512.o", "generic.o", "-lm", "-o", "harness"],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CountError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out / "harness"


_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S.*)$")
_FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")


def block_weights(binary: Path) -> dict[int, int]:
    """{return address of a __sanitizer_cov_trace_pc call: instructions of its block}
    from `objdump -d` of `binary` (see the module docstring for the rule). A block
    that only returns becomes a tail call, `jmp __sanitizer_cov_trace_pc`, whose hits
    land on the return address of its function's caller: every address after another
    call gets weight 1 (the return the jump replaced) unless it is a call site too."""
    proc = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-M", "att", str(binary)], capture_output=True,
                          text=True, check=True)
    weights: dict[int, int] = {}
    after_call: set[int] = set()
    current = None    # return address of the last call site in this function
    prologue = 0      # instructions of this function before its first call site
    pending = None    # the call instruction whose next instruction is the return address
    for line in proc.stdout.splitlines():
        if _FUNC.match(line):
            current, prologue, pending = None, 0, None
            continue
        m = _INSN.match(line)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2)
        if pending == "hook":
            current, pending = addr, None
            weights[current] = prologue
            prologue = 0
        elif pending == "call":
            after_call.add(addr)
            pending = None
        if text.startswith(("call", "jmp")) and f"<{HOOK}>" in text:
            pending = "hook" if text.startswith("call") else None
            continue
        if text.startswith("call"):
            pending = "call"
        if text.startswith(("nop", "xchg   %ax,%ax", "data16", "cs nop")):
            continue
        if current is None:
            prologue += 1
        else:
            weights[current] += 1
    for addr in after_call - weights.keys():
        weights[addr] = 1
    return weights


class NotInCommit(CountError):
    """The commit's C API has no such pass (a backward before there was one)."""


def run_config(binary: Path, kind: str, shape: str, causal: bool, threads: int = 1) -> dict[int, int]:
    """{block: hits} of one counted call."""
    with tempfile.NamedTemporaryFile(prefix="avx512count-", suffix=".txt") as f:
        proc = subprocess.run([str(binary), "fwd" if kind == "forward" else "bwd", shape, str(int(causal)),
                               str(threads), f.name], capture_output=True, text=True)
        if proc.returncode == 5:
            raise NotInCommit(proc.stderr.strip().removeprefix("harness: "))
        if proc.returncode != 0:
            raise CountError(f"{binary} {kind} {shape} causal={causal} failed ({proc.returncode}): "
                             f"{proc.stderr[-1000:]}")
        return {int(a, 16): int(h) for a, h in (line.split() for line in Path(f.name).read_text().splitlines())}


def count(binary: Path, cfgs, threads: int = 1) -> dict[str, dict]:
    """{key: {"instructions", "blocks" (hook calls), "block_sites"}} for each configuration
    ({key: {"error"}} for a pass the commit does not have)."""
    weights = block_weights(binary)
    out = {}
    for kind, shape, causal in cfgs:
        try:
            hits = run_config(binary, kind, shape, causal, threads)
        except NotInCommit as exc:
            out[config_key(kind, shape, causal)] = {"error": str(exc)}
            continue
        # an instrumented function called from a shared library (OpenMP's outlined
        # parallel regions, from libgomp) whose last block tail-calls the hook: its
        # return, one instruction, at an address outside this executable
        low, high = min(weights), max(weights)
        hits_out = {a: h for a, h in hits.items() if a not in weights and not low <= a <= high}
        unknown = [hex(a) for a in hits if a not in weights and a not in hits_out]
        if unknown:
            raise CountError(f"{len(unknown)} counted addresses are no call site of {HOOK}: {unknown[:5]}")
        out[config_key(kind, shape, causal)] = {
            "instructions": sum(h * weights.get(a, 1) for a, h in hits.items()),
            "blocks": sum(hits.values()), "block_sites": len(hits)}
    return out


def count_source(src: Path, cfgs, work: Path, threads: int = 1) -> dict[str, dict]:
    """Build the harness of `src` in `work` and count every configuration."""
    return count(build(src, work), cfgs, threads)


def count_commits(repo: Path, shas: dict[str, str], cfgs, log=print) -> dict[str, dict[str, dict]]:
    """{side: counts} for {side: commit}, each built from its own sources; the sides
    at once (a build is one gcc process at a time, and the counts do not depend on
    the machine's load)."""
    with tempfile.TemporaryDirectory(prefix="attnkern-avx512count-") as tmp:
        def one(side, sha):
            t0 = time.perf_counter()
            src = export_sources(repo, sha, Path(tmp) / side / "src")
            counts = count_source(src, cfgs, Path(tmp) / side / "build")
            log(f"avx512-counted {side} {sha[:10]}: built and counted in {time.perf_counter() - t0:.0f} s")
            return counts

        with ThreadPoolExecutor(max_workers=len(shas)) as pool:
            futures = {side: pool.submit(one, side, sha) for side, sha in shas.items()}
            return {side: future.result() for side, future in futures.items()}


def rows(counted: dict[str, dict[str, dict]], threshold: float) -> list[dict]:
    """Rows of the gate's table (tools/gate_table.py print_table), signal 'avx512-counted'."""
    out = []
    for key, base in counted["baseline"].items():
        cand = counted["candidate"][key]
        if "error" in base or "error" in cand:
            out.append({"benchmark": key, "signal": "avx512-counted", "verdict": "skipped",
                        "note": base.get("error") or cand.get("error")})
            continue
        ratio = cand["instructions"] / base["instructions"]
        verdict = "slower" if ratio > 1 + threshold else "faster" if ratio < 1 - threshold else "same"
        out.append({"benchmark": key, "signal": "avx512-counted", "unit": "instructions",
                    "baseline": base["instructions"], "candidate": cand["instructions"], "ratio": ratio,
                    "interval": [ratio, ratio], "verdict": verdict, "baseline_counts": base,
                    "candidate_counts": cand})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/avx512_count.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="baseline commit")
    parser.add_argument("--head", default="HEAD", help="candidate commit (default HEAD; uncommitted edits unseen)")
    parser.add_argument("--repo", default=str(REPO))
    parser.add_argument("--source-dir", help="only count the native sources in this directory (no comparison)")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help=f"BxHxNxD shapes (default {' '.join(SHAPES)})")
    parser.add_argument("--passes", nargs="+", default=PASSES, choices=PASSES)
    parser.add_argument("--threshold", type=float, default=0.01, help="relative change counted slower (default 0.01)")
    parser.add_argument("--json", help="write the counts and rows to this file")
    args = parser.parse_args(argv)
    if not args.base and not args.source_dir:
        parser.error("give --base (compare two commits) or --source-dir (count one tree)")
    why = missing()
    if why:
        print(f"avx512-counted: skipped: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why}, indent=1))
        return 0
    cfgs = configs(args.shapes, args.passes)
    t0 = time.perf_counter()
    if args.source_dir:
        with tempfile.TemporaryDirectory(prefix="attnkern-avx512count-") as tmp:
            counts = count_source(Path(args.source_dir), cfgs, Path(tmp))
        for key, c in counts.items():
            print(f"{key:<40} skipped: {c['error']}" if "error" in c else
                  f"{key:<40} {c['instructions']:>14,} instructions {c['blocks']:>12,} blocks")
        if args.json:
            Path(args.json).write_text(json.dumps({"counts": counts}, indent=1))
        return 0
    repo = Path(args.repo)
    shas = {"baseline": resolve(repo, args.base), "candidate": resolve(repo, args.head)}
    counted = count_commits(repo, shas, cfgs, log=lambda m: print(m, file=sys.stderr))
    table = rows(counted, args.threshold)
    print(f"# {shas['baseline'][:10]} (baseline) -> {shas['candidate'][:10]} (candidate)")
    print(f"# avx512-counted: instructions of attn_avx512.c in one call, 1 thread, trace-pc instrumentation; "
          f"slower above {args.threshold:+.1%}")
    print_table(table)
    slower = [r for r in table if r["verdict"] == "slower"]
    minutes = (time.perf_counter() - t0) / 60
    print(f"# {len(slower)} slower, {sum(r['verdict'] == 'faster' for r in table)} faster, "
          f"{sum(r['verdict'] == 'same' for r in table)} unchanged; {minutes:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": shas["baseline"], "candidate": shas["candidate"],
                                               "threshold": args.threshold, "minutes": minutes, "rows": table},
                                              indent=1))
    return 1 if slower else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (CountError, GateError, OSError, subprocess.CalledProcessError) as exc:
        print(f"avx512_count: {exc}", file=sys.stderr)
        raise SystemExit(2)
