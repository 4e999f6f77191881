"""Every name a benchmark imports from titanrl or from a sibling benchmark exists.

Benchmarks import most things inside `main()` (after argument parsing, so `--help` is fast), so
a renamed helper only shows when someone runs the benchmark for minutes. This reads each
benchmark's import statements (at any depth) and resolves them without running the benchmark.
"""

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of every import in `path` that names titanrl or a sibling benchmark."""
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in {"titanrl", *siblings}:
                found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names
                      if alias.name.split(".")[0] in {"titanrl", *siblings}]
    return found


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports_resolve(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run as a script
    missing = []
    for module, name, line in _imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"line {line}: {module} ({e})")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"line {line}: {module} has no {name!r}")
    assert not missing, f"{path.name} imports what does not exist: {missing}"
