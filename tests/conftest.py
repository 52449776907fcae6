"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import budget
import jax

jax.config.update("jax_num_cpu_devices", 8)
# No persistent compilation cache: a multi-device CPU program loaded from it can deadlock
# (co2jax.compilation_cache; CO2's resume test did, every time).


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow``, and the cases of a grid its ``cases`` rule leaves out
    (``tests/budget.py``), run only when asked for (``-m slow``, or any ``-m`` naming it)."""
    left = budget.slow_cases(items)
    for item in items:
        if item.nodeid in left:
            item.add_marker(pytest.mark.slow)
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
