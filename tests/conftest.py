"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU back end without LLVM's costlier optimizations: the tests' programs are tiny and
# compiling is most of their time (the default suite: 887 s of test time against 706 s).
# The HLO passes, and so every schedule, collective and memory figure a test reads, are the
# same; values may differ from an optimized build in the last ulp (float32 rounding), which
# is what every tolerance allows. Inherited by the runs the tests start as subprocesses.
# libtpu's compiler does not read these (the TPU ahead-of-time tests' programs are the same).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

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
