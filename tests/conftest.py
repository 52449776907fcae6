"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only when asked for (``-m slow``, or any ``-m`` naming it)."""
    import pytest

    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
