"""The default suite's share of the tests (tests/budget.py): its rules do what they say, a new
algorithm gets its share by registering, and .ci/run runs every test the default leaves out."""

import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path

import budget
import pytest

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


def function_of(node: str) -> str:
    """A node id without its parametrized case: ``f.py::test_g[a-b]`` -> ``f.py::test_g``."""
    return node.split("[")[0]


def test_each_keeps_every_value_of_every_parameter_and_not_the_whole_grid():
    grid = [{"a": a, "b": b, "c": c} for a in "xyz" for b in (1, 2) for c in (None, 0.5)]
    kept = budget.each(grid)
    for name in ("a", "b", "c"):
        assert {repr(grid[i][name]) for i in kept} == {repr(g[name]) for g in grid}, name
    assert len(kept) <= 3 + 2 + 2 - 2 < len(grid) and kept == sorted(
        kept
    )  # at most one per new value


def test_the_algorithm_rule_runs_one_algorithm_in_n_and_covers_the_rest():
    order = budget.algorithm_order()
    grid = [{"name": name, "reducer": r} for name in order for r in ("pmean", "all_gather")]
    kept = budget.by_algorithm("tests/test_x.py::test_y", grid, 3)
    shift = budget.offset("tests/test_x.py::test_y", 3)
    chosen = {grid[i]["name"] for i in kept}
    assert chosen == {n for p, n in enumerate(order) if (p + shift) % 3 == 0}
    assert {grid[i]["reducer"] for i in kept} == {"pmean", "all_gather"}
    # a grid over some algorithms only still runs one of them
    few = [{"name": n} for n in order[:2]]
    assert len(budget.by_algorithm("tests/test_x.py::test_z", few, 19)) == 1


def test_a_new_algorithm_gets_its_share_by_registering(monkeypatch):
    """Registering an algorithm (here a name appended to the order) gives it the default
    cases of one in n of every check it inherits, with no list to edit."""
    order = (*budget.algorithm_order(), "brand_new")
    monkeypatch.setattr(budget, "algorithm_order", lambda: order)
    tests = [f"tests/test_x.py::test_{i}" for i in range(40)]
    got = sum(
        "brand_new" in {order[i] for i in budget.by_algorithm(t, [{"a": n} for n in order], 4)}
        for t in tests
    )
    assert 5 <= got <= 15, got  # about a quarter of the 40


def test_the_matrix_default_cells_follow_its_rule():
    """Every algorithm in every driver it runs in and at every layout; the one-device
    drivers at the whole layout; across algorithms, every mesh driver at every layout."""
    import test_matrix as m

    default = {c for c in m.CELLS if m.runs_by_default(*c)}
    for name in m.NAMES:
        for driver in m.DRIVERS:
            if (name, driver) not in m.NOT_APPLICABLE:
                assert any(c[:2] == (name, driver) for c in default), (name, driver)
        for driver in m.ON_ONE_DEVICE:
            if (name, driver) not in m.NOT_APPLICABLE:
                assert (name, driver, "replicated") in default, (name, driver)
        for layout in m.SPLIT:
            assert any(c[0] == name and c[2] == layout for c in default), (name, layout)
    for layout in ("replicated", *m.SPLIT):
        for driver in m.ON_A_MESH:
            assert any(c[1:] == (driver, layout) for c in default), (driver, layout)
    assert any(c[2] in m.ENGINE_ONLY for c in default)
    assert len(default) < len(m.CELLS) * 0.45  # the rest with -m slow


def test_a_cases_mark_without_its_count_or_with_another_rule_is_refused():
    with pytest.raises(ValueError, match=r"rule='most'"):
        budget.default_cases("t", "most", None, [{"a": 1}])

    class Item:
        nodeid = "tests/test_x.py::test_y[a]"

        def get_closest_marker(self, name):
            return pytest.mark.cases("first").mark

    with pytest.raises(ValueError, match=r"test_y\[a\]: cases\('first', n\) needs n >= 1"):
        budget.rule_of(Item())


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
