"""The default suite's time budget (tests/budget.txt): every name in it is a collected test,
its slow tests and the cases its grids do not keep run with -m slow only, and the kept cases
run by default."""

import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import function_of, read_budget

ROOT = Path(__file__).resolve().parents[1]


_PROBE = """
import sys, pytest
class Probe:
    def pytest_collection_finish(self, session):
        for item in session.items:
            marks = [m for m in ("slow", "processes") if m in item.keywords]
            print(",".join(marks or ["-"]), item.nodeid)
sys.exit(pytest.main(["--collect-only", "-q", "-m", "slow or not slow"], plugins=[Probe()]))
"""
MARKS = ("slow", "processes")  # the marks .ci/run's -m expressions select on


@functools.cache  # one collection for every test below (each takes seconds)
def _marks() -> dict[str, frozenset[str]]:
    """Every collected node id with the marks among :data:`MARKS` it carries."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    marks = {}
    for line in out.splitlines():
        names, _, node = line.partition(" ")
        if "::" in node:
            marks[node] = frozenset(names.split(",")) - {"-"}
    return marks


def _collected(markexpr: str | None) -> frozenset[str]:
    """Node ids ``pytest -m markexpr`` runs (``None``: no -m, every test); ``markexpr`` is a
    boolean expression over :data:`MARKS`, as pytest reads it."""
    if markexpr is None:
        return frozenset(_marks())
    code = compile(markexpr, "-m", "eval")
    unknown = set(code.co_names) - set(MARKS)
    assert not unknown, f"-m {markexpr!r} selects on marks this check does not read: {unknown}"
    return frozenset(
        node
        for node, marks in _marks().items()
        if eval(code, {"__builtins__": {}}, {m: m in marks for m in MARKS})
    )


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


def _ci_markexprs() -> list[str]:
    """The marker expressions of the pytest runs of .ci/run over the whole suite: the README's
    test command (no -m: the default suite, "not slow") and those .ci/run adds."""
    readme = (ROOT / "README.md").read_text().split("<!-- test-command -->")[1]
    command = readme.splitlines()[2].rpartition("-m pytest")[2]
    assert "-m pytest" in readme.splitlines()[2] and " -m " not in command, command
    exprs = ["not slow"]
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        if "pytest" not in line or line.lstrip().startswith("#") or "tests/" in line:
            continue  # a comment, or a run of one file
        match = re.search(r"""-m (?:"([^"]+)"|'([^']+)'|(\S+))""", line.partition("pytest")[2])
        exprs.append(next(g for g in match.groups() if g) if match else "not slow")
    return exprs


def test_ci_runs_every_test_and_every_inherited_check_of_every_algorithm():
    """.ci/run's runs leave no collected test out, and every check an algorithm inherits (a
    test with a case for every registered algorithm) runs all its cases there."""
    from co2jax.algorithms import registry

    exprs = _ci_markexprs()
    assert exprs[0] == "not slow" and len(exprs) >= 2, exprs
    runs = [_collected(e) for e in exprs]
    ran = set().union(*runs)
    everything = _collected(None)
    assert everything <= ran, sorted(everything - ran)[:10]
    for i, (a, b) in enumerate(itertools.combinations(runs, 2)):  # no test runs twice
        assert not a & b, (i, sorted(a & b)[:5])
    assert _collected("slow") == ran - runs[0]  # the later runs: exactly the slow tests
    cases: dict[str, dict[str, set[str]]] = {}  # test -> algorithm -> its cases
    for node in everything:
        params = node.partition("[")[2].rstrip("]").split("-")
        for name in registry.NAMES:
            if name in params:
                cases.setdefault(function_of(node), {}).setdefault(name, set()).add(node)
    inherited = {t: by for t, by in cases.items() if set(by) == set(registry.NAMES)}
    assert len(inherited) >= 10, sorted(inherited)
    for test, by in inherited.items():
        for name, nodes in by.items():
            assert nodes <= ran, f"{test}: {name}'s cases {sorted(nodes - ran)} never run in CI"
