"""The default suite's time budget (tests/budget.txt): every name in it is a collected test,
its slow tests and the cases its grids do not keep run with -m slow only, and the kept cases
run by default."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import function_of, read_budget

ROOT = Path(__file__).resolve().parents[1]


def _collected(markexpr: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", markexpr],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line for line in out.splitlines() if "::" in line}


def test_every_budget_name_is_a_test_and_lands_on_its_side():
    slow, quick = read_budget()
    default, deliberate = _collected("not slow"), _collected("slow")
    assert default and deliberate and not default & deliberate
    by_test = {}
    for node in default | deliberate:
        by_test.setdefault(function_of(node), set()).add(node)
    assert not slow - set(by_test), (
        f"budget.txt names tests that do not exist: {sorted(slow - set(by_test))}"
    )
    assert not quick - default, f"budget.txt keeps cases that do not run: {sorted(quick - default)}"
    for name in slow:
        assert by_test[name] <= deliberate, name
    for grid in {function_of(node) for node in quick}:
        assert grid not in slow, f"{grid} is both slow and a thinned grid"
        assert by_test[grid] - quick <= deliberate, grid


def test_a_malformed_budget_line_is_refused_with_its_line(tmp_path):
    path = tmp_path / "budget.txt"
    path.write_text("# a comment\n\nslow tests/test_a.py::test_b\nfast tests/test_a.py::test_c\n")
    with pytest.raises(ValueError, match=r"budget.txt:4: expected 'slow NODE' or 'quick NODE'"):
        read_budget(path)
