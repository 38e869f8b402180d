"""The measurement (attnkern_bench/, benchmarks/, tools/, dev/) uses attnkern's
public names only: no module of it imports an underscore name of attnkern
(`from attnkern._x import y`, `from attnkern.m import _y`, `import
attnkern.backends.native._attn`) or reaches one as an attribute
(`attnkern._api`, `native._attn` where native is an attnkern module). Read with
ast, so nothing is run."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = ("attnkern_bench", "benchmarks", "tools", "dev")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each use of an underscore name of attnkern in source."""
    tree = ast.parse(source)
    bound = set()  # local names of attnkern modules and objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "attnkern":
                    if any(map(_private, parts)):
                        found.append((node.lineno, f"import {alias.name}"))
                    bound.add(alias.asname or "attnkern")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "attnkern":
                continue
            for alias in node.names:
                if any(map(_private, parts)) or _private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, f"{ast.unparse(node)}"))
    return found


def test_the_detector_sees_each_form():
    source = """
import attnkern
import attnkern.backends.native._attn
from attnkern._api import validate
from attnkern.backends.torch import _threads
from attnkern.backends import native as nat
from attnkern import kernels, __version__
attnkern._api.choose
nat._attn.fma_peak
attnkern.__version__
"""
    assert [what for _, what in private_uses(source)] == [
        "import attnkern.backends.native._attn", "from attnkern._api import validate",
        "from attnkern.backends.torch import _threads", "attnkern._api", "nat._attn"]


def _files():
    for folder in OUTSIDE:
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_measurement_uses_public_names_only(path):
    uses = private_uses(path.read_text())
    assert not uses, f"{path.relative_to(ROOT)} uses attnkern's private names: " + ", ".join(
        f"line {line}: {what}" for line, what in uses)
