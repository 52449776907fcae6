"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

# One persistent compilation cache for the session: the drivers' tests build the same round
# programs many times (a run, then its resume), and a cached executable is the same program.
_CACHE = tempfile.mkdtemp(prefix="co2jax-test-xla-cache-")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only when asked for (``-m slow``, or any ``-m`` naming it)."""
    import pytest

    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
