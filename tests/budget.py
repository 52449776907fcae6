"""Which tests the default suite (the README's command) runs, and which wait for ``-m slow``:
rules, read from marks in the test files and from the registry, never a list of test ids.

``tests/conftest.py`` applies them; ``tests/test_budget.py`` checks them and that ``.ci/run``
runs everything they leave out.

- ``@pytest.mark.slow`` on a test: it runs with ``-m slow`` only (the mark's comment says why,
  and which quicker twin stays in the default suite).
- ``@pytest.mark.cases(rule, n)`` on a parametrized test: the default suite runs the cases
  ``rule`` picks, the others run with ``-m slow``:

  - ``"each"``: a covering set, in which every value of every parameter appears in at least
    one case (greedy, in collection order: a case is kept when it brings a value not yet
    seen);
  - ``"first"``: the first ``n`` cases (a grid of cases alike: shapes, documentation blocks);
  - ``"algorithms"``: a check every algorithm inherits (a parameter over the registered
    algorithms and their variants) runs by default for one algorithm in ``n``: those at
    positions ``p`` of :func:`algorithm_order` with ``(p + offset) % n == 0``, ``offset`` a
    stable hash of the test's name (on a grid of some algorithms only, where none falls on 0,
    those with the least ``(p + offset) % n``), so each algorithm, a new one included, gets
    about one in ``n`` of its inherited checks; the other parameters among them by ``"each"``;
  - ``rule=f``, a function of the case's parameters (``f(**params) -> bool``): the algorithm
    x driver x layout matrix's (``tests/test_matrix.py``).

  A parametrized test with no ``cases`` mark runs whole by default.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

RULES = ("each", "first", "algorithms")


def algorithm_order() -> tuple[str, ...]:
    """The registered algorithms, then the textbook's variants of them: positions for the
    ``"algorithms"`` rule."""
    import textbook as tb

    from co2jax.algorithms import registry

    return (*registry.NAMES, *tb.VARIANTS)


def _key(value) -> str:
    return value if isinstance(value, str) else repr(value)


def each(cases: list[dict]) -> list[int]:
    """Indices of a covering subset of ``cases`` (dicts of parameter values): every value of
    every parameter in at least one kept case."""
    seen, kept = set(), []
    for i, params in enumerate(cases):
        values = {(name, _key(v)) for name, v in params.items()}
        if values - seen:
            kept.append(i)
            seen |= values
    return kept


def algorithm_parameter(cases: list[dict], order: Iterable[str]) -> str | None:
    """The parameter of a grid over algorithms (one whose every value names an algorithm),
    or ``None``."""
    names = set(order)
    for name in cases[0] if cases else ():
        if all(isinstance(c[name], str) and c[name] in names for c in cases):
            return name
    return None


def offset(test: str, n: int) -> int:
    """A stable offset in ``[0, n)`` for ``test`` (a function's node id, no case)."""
    return zlib.crc32(test.encode()) % n


def by_algorithm(test: str, cases: list[dict], n: int) -> list[int]:
    """The ``"algorithms"`` rule: the cases of one algorithm in ``n`` (by position; where
    the grid holds only some algorithms and none of its own falls on the rotation, those
    nearest after it), then a covering set of the other parameters among them."""
    order = algorithm_order()
    param = algorithm_parameter(cases, order)
    if param is None:
        raise ValueError(f"{test}: cases('algorithms', n) on a grid with no algorithm parameter")
    turn = {i: (order.index(c[param]) + offset(test, n)) % n for i, c in enumerate(cases)}
    first = min(turn.values())
    chosen = [i for i in range(len(cases)) if turn[i] == first]
    rest = [{k: v for k, v in cases[i].items() if k != param} for i in chosen]
    firsts = {cases[i][param]: i for i in reversed(chosen)}  # each chosen algorithm once
    return sorted(set(firsts.values()) | {chosen[j] for j in each(rest)})


def default_cases(test: str, rule, n: int | None, cases: list[dict]) -> list[int]:
    """Indices of ``cases`` (one test's, in collection order) that the default suite runs."""
    if callable(rule):
        return [i for i, params in enumerate(cases) if rule(**params)]
    if rule == "each":
        return each(cases)
    if rule == "first":
        return list(range(min(n, len(cases))))
    if rule == "algorithms":
        return by_algorithm(test, cases, n)
    raise ValueError(f"cases: rule={rule!r}: expected one of {RULES} or a function")


def rule_of(item) -> tuple[str | Callable, int | None] | None:
    """``(rule, n)`` of an item's ``cases`` mark, or ``None``."""
    mark = item.get_closest_marker("cases")
    if mark is None:
        return None
    rule, *rest = mark.args or (mark.kwargs.get("rule"),)  # a function: rule=f (a lone
    n = rest[0] if rest else mark.kwargs.get("n")  # callable argument would be decorated)
    if rule in ("first", "algorithms") and not (isinstance(n, int) and n >= 1):
        raise ValueError(f"{item.nodeid}: cases({rule!r}, n) needs n >= 1, got n={n!r}")
    return rule, n


def slow_cases(items) -> set[str]:
    """Node ids of the parametrized cases the ``cases`` rules leave to ``-m slow``."""
    grids: dict[str, list] = {}
    for item in items:
        if getattr(item, "callspec", None) is not None and rule_of(item) is not None:
            grids.setdefault(item.nodeid.split("[")[0], []).append(item)
    slow = set()
    for test, grid in grids.items():
        rule, n = rule_of(grid[0])
        keep = set(default_cases(test, rule, n, [dict(i.callspec.params) for i in grid]))
        slow |= {item.nodeid for j, item in enumerate(grid) if j not in keep}
    return slow
