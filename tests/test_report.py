"""attnkern report, checked as a reader would: two PDF pages with figures on them,
an HTML page that renders in headless Chromium, and findings that state numbers."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from attnkern_bench import cli

DATA = Path(__file__).resolve().parents[1] / "docs" / "data"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    small = ["--sizes", "64", "128", "--heads", "1", "--repeat", "1", "--kernels", "native.flash", "numpy.naive"]
    assert cli.main(["bench", *small, "--passes", "1", "--settle", "0", "--json", str(out / "bench.json")]) == 0
    assert cli.main(["roofline", *small, "--stream-mib", "64", "--json", str(out / "roofline.json")]) == 0
    grid = DATA / "tune-grid-native-flash-1x8x1024x64.json"
    assert cli.main(["report", "--out", str(out), "--bench", str(out / "bench.json"), "--roofline",
                     str(out / "roofline.json"), "--tune-grid", str(grid), "--tune-replay",
                     str(DATA / f"replay-{grid.name}"), "--study", str(DATA / "study-h100.json")]) == 0
    return out


def test_the_pdf_has_two_pages_with_figures(report):
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
    text = (report / "report.txt").read_text()
    assert "AMD" in text or "Intel" in text or "CPU" in text
    assert "Fastest kernel per configuration" in text and "GFLOP/s" in text and "roofline" in text
    assert "commit" in text and "seed 0" in text


def test_the_html_renders_in_chromium(report):
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
