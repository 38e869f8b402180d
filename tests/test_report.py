"""attnkern report --quick (make bench's report), checked as a reader would: every
command it runs ran and its kernels passed their checks, two PDF pages with figures
on them, an HTML page that renders in headless Chromium, and findings that state
numbers."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from attnkern_bench import cli
from attnkern_bench import report as report_module


# `report --quick`'s runs with smaller arguments: the same commands and the same pipeline
# (each command run, its JSON written, loaded and reported) in a minute instead of several
SMALLER = {"--sizes": ["64", "128"], "--heads": ["1"], "--repeat": ["1"], "--seqs": ["32", "64"], "--dims": ["8"],
           "--iters": ["1"], "--batch": ["1"], "--shape": ["1x1x64x8"], "--seeds": ["3"],
           "--kernels": ["native.flash", "numpy.naive"]}


def smaller(argv):
    out, i = [], 0
    while i < len(argv):
        out.append(argv[i])
        i += 1
        if out[-1] in SMALLER:
            out += SMALLER[out[-1]]
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
    if out[0] == "roofline":
        out += ["--stream-mib", "16"]
    if out[0] == "study":
        out += ["--kernels", "native.flash"]
    if "minilm" in out:  # the model's inputs at N = 64 only
        del out[out.index("--sizes") + 2]
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """`attnkern report --quick`, its commands' arguments made smaller; the commands it ran."""
    out = tmp_path_factory.mktemp("report")
    real, ran = report_module.run_command, []

    def run_command(argv):  # what report.quick_inputs calls for each command
        ran.append(argv[0] + "".join(f" {flag}" for flag in ("--inputs", "--record-grid", "--replay") if flag in argv))
        return real(smaller(argv))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_module, "run_command", run_command)
        assert cli.main(["report", "--quick", "--out", str(out), "--threads", "2"]) == 0
    return out, ran


def test_quick_runs_every_command_and_every_kernel_passes_its_check(report):
    out, ran = report
    assert ran == ["bench", "roofline", "study", "bench --inputs", "tune --record-grid", "tune --replay"]
    for name in ("bench.json", "roofline.json", "study.json", "bench-minilm.json", "tune-grid.json",
                 "tune-replay.json", "report.pdf", "report.html", "report.txt"):
        assert (out / name).stat().st_size > 0, name
    # every kernel checked against float64 passed, on random and on MiniLM inputs
    for name in ("bench.json", "bench-minilm.json"):
        rows = json.loads((out / name).read_text())["rows"]
        assert rows and all(r["ok"] for r in rows), name
    assert json.loads((out / "study.json").read_text())["rows"]
    assert json.loads((out / "tune-replay.json").read_text())["seeds"] == 3


def test_the_pdf_has_two_pages_with_figures(report):
    report, _ = report
    if shutil.which("pdftoppm") is None:
        pytest.fail("pdftoppm is not installed: run `make setup` (it installs Debian's poppler-utils)")
    subprocess.run(["pdftoppm", "-r", "40", "-png", str(report / "report.pdf"), str(report / "page")], check=True)
    pages = sorted(report.glob("page-*.png"))
    assert len(pages) == 2
    import matplotlib.image as mpimg

    for page in pages:
        pixels = mpimg.imread(page)[..., :3]
        ink = (pixels < 0.9).any(axis=-1).mean()  # the share of the page that is not white
        colours = len(np.unique((pixels * 15).round().reshape(-1, 3), axis=0))
        assert ink > 0.05 and colours > 20, (page.name, ink, colours)  # figures, not a blank or text-only page


def test_the_findings_state_numbers(report):
    text = (report[0] / "report.txt").read_text()
    assert "AMD" in text or "Intel" in text or "CPU" in text
    assert "Fastest kernel per configuration" in text and "GFLOP/s" in text and "roofline" in text
    assert "commit" in text and "seed 0" in text and "MiniLM" in text


def test_the_html_renders_in_chromium(report):
    report, _ = report
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.fail("chromium is not installed: run `make setup`")
    shot = report / "html.png"
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                    "--window-size=1000,1400", f"--screenshot={shot}", (report / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    dom = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", "--dump-dom", (report / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<img") == 2 and "Fastest kernel" in dom
    assert shot.stat().st_size > 20_000

