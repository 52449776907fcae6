"""The persistent-compilation-cache guard: multi-device CPU programs stay out of the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

import co2jax
from co2jax import compilation_cache
from experiments import config as config_lib
from experiments import programs


@pytest.fixture
def cache_on(tmp_path):
    """JAX's persistent cache switched on (as a user's JAX_COMPILATION_CACHE_DIR would), and
    the session's settings restored afterwards."""
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla-cache"))
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        yield tmp_path / "xla-cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_enable_compilation_cache", saved[1])
        cc.reset_cache()


def test_no_hazard_without_the_cache_or_with_one_device(cache_on):
    cpus = jax.devices("cpu")
    assert compilation_cache.unsafe_reason(cpus[:1]) is None  # nothing to order
    reason = compilation_cache.unsafe_reason(cpus[:8])
    assert str(cache_on) in reason and "8 CPU devices" in reason
    jax.config.update("jax_enable_compilation_cache", False)
    assert compilation_cache.unsafe_reason(cpus[:8]) is None


def test_the_guard_warns_or_turns_the_cache_off(cache_on):
    cpus = jax.devices("cpu")[:2]
    with pytest.warns(UserWarning, match=r"2 CPU devices.*turn it off"):
        assert compilation_cache.guard(cpus)
    assert jax.config.jax_enable_compilation_cache  # a warning only
    with pytest.warns(UserWarning, match="turned it off"):
        assert compilation_cache.guard(cpus, disable=True)
    assert not jax.config.jax_enable_compilation_cache
    assert not compilation_cache.guard(cpus)  # and now there is nothing to say


def test_the_round_engine_warns_on_a_cpu_mesh(cache_on):
    mesh = co2jax.make_mesh(replica=2, data=2, devices=jax.devices("cpu")[:4])
    with pytest.warns(UserWarning, match="4 CPU devices"):
        co2jax.RoundTrainer(lambda p, b: jnp.sum(p), optax.sgd(0.1), co2jax.co2(0.5, 0.2), mesh, 2)


def test_the_training_driver_turns_the_cache_off(cache_on, tmp_path):
    """Before it compiles anything: CO2's resume test aborted in XLA's rendezvous when its
    round came from the cache."""
    cfg = config_lib.override(
        config_lib.preset("micro"), [f"log.dir={tmp_path}", "outer.algorithm=co2"]
    )
    with pytest.warns(UserWarning, match="turned it off"):
        programs.build(cfg)
    assert not jax.config.jax_enable_compilation_cache
    assert not list(cache_on.glob("*"))  # nothing was written to it
