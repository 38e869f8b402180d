"""Every source file the package needs at run time is installed by meson.

The tests run on an editable install, which imports from the source tree, so a
module or CUDA source left out of a meson.build ``install_sources`` list passes
every other test and fails only for users of the built wheel (the GPU machine
installs a wheel). This test reads the meson.build files and compares their
install lists with the tracked files."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attnkern", "attnkern_bench")
RUNTIME = (".py", ".cu", ".cuh")  # loaded at run time; C and Cython sources are compiled instead


def installed_files() -> set[str]:
    """Paths (relative to the root) that the meson.build files install with install_sources."""
    out = set()
    for build in ROOT.glob("attnkern*/**/meson.build"):
        text = re.sub(r"#[^\n]*", "", build.read_text())
        for call in re.finditer(r"install_sources\((.*?)\)", text, re.S):
            body = call.group(1)
            subdir = re.search(r"subdir\s*:\s*'([^']+)'", body)
            assert subdir, f"{build}: install_sources without subdir: {body!r}"
            names = re.findall(r"'([^']+)'", body.split("subdir")[0])
            base = subdir.group(1)
            # a name with a folder ('cuda/launch.py') installs into subdir/that folder
            prefix = str(build.parent.relative_to(ROOT))
            for name in names:
                assert (build.parent / name).is_file(), f"{build} installs {name}, which does not exist"
                rel = f"{base}/{Path(name).name}"
                out.add(rel)
                assert rel == f"{prefix}/{name}", f"{build}: {name} installs to {rel}, not beside its source"
    return out


def tracked_runtime_files() -> set[str]:
    try:
        listed = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return {f for f in listed if f.endswith(RUNTIME)}


def test_every_runtime_source_is_installed():
    missing = sorted(tracked_runtime_files() - installed_files())
    assert not missing, f"not in any meson.build install_sources (a wheel would lack them): {missing}"


def test_the_parser_finds_known_files():
    # the parser finds the files it should: the CUDA sources numba-cuda compiles and a nested module
    found = installed_files()
    assert "attnkern/backends/cuda/flash_common.cuh" in found
    assert "attnkern_bench/study/model.py" in found
    assert "attnkern/backends/cuda/flash_bwd_mma.cu" in tracked_runtime_files()
