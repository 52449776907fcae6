"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
# No persistent compilation cache: a multi-device CPU program loaded from it can deadlock
# (co2jax.compilation_cache; CO2's resume test did, every time).


BUDGET = Path(__file__).with_name("budget.txt")


def read_budget(path: Path = BUDGET) -> tuple[set[str], set[str]]:
    """``budget.txt``'s two lists: whole tests run with ``-m slow`` only, and the cases of
    parametrized tests that the default suite keeps (node ids as pytest prints them)."""
    slow, quick = set(), set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, _, node = line.partition(" ")
        if kind not in ("slow", "quick") or not node:
            raise ValueError(
                f"{path.name}:{number}: expected 'slow NODE' or 'quick NODE', got {line!r}"
            )
        (slow if kind == "slow" else quick).add(node)
    return slow, quick


def function_of(node: str) -> str:
    """A node id without its parametrized case: ``f.py::test_g[a-b]`` -> ``f.py::test_g``."""
    return node.split("[")[0]


def budget_marks(items, slow: set[str], quick: set[str]) -> None:
    """Marks ``slow`` the tests budget.txt names and the cases of its thinned grids that it
    does not keep."""
    grids = {function_of(node) for node in quick}
    for item in items:
        base = function_of(item.nodeid)
        if base in slow or (base in grids and item.nodeid not in quick):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (in the file, or by budget.txt) run only when asked for
    (``-m slow``, or any ``-m`` naming it)."""
    budget_marks(items, *read_budget())
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
