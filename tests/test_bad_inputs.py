"""Bad input raises a clear error naming the argument and the value, before any compute."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import co2jax
from co2jax import penalties

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: co2jax.co2(0.0, 0.5), "learning_rate=0.0"),
        (lambda: co2jax.co2(-1.0, 0.5), "learning_rate=-1.0"),
        (lambda: co2jax.co2(float("nan"), 0.5), "learning_rate=nan"),
        (lambda: co2jax.co2("1", 0.5), "learning_rate='1'"),
        (lambda: co2jax.co2(1.0, 1.0), "momentum=1.0"),
        (lambda: co2jax.co2(1.0, -0.1), "momentum=-0.1"),
        (lambda: co2jax.co2(1.0, 0.5, clip_threshold=0.0), "clip_threshold=0.0"),
        (lambda: co2jax.co2(1.0, 0.5, clip_threshold=-2), "clip_threshold=-2"),
        (lambda: co2jax.co2(1.0, 0.5, mode="papr"), "mode='papr'"),
        (
            lambda: co2jax.co2(1.0, 0.5, penalty=penalties.gap_aware(), mode="reference_code"),
            "penalty=",
        ),
        (lambda: co2jax.co2(1.0, 0.5, penalty=3.0), "penalty=3.0"),
        (lambda: co2jax.diloco("sgd"), "outer_optimizer='sgd'"),
        (lambda: co2jax.delayed_diloco(NESTEROV, delay=-1), "delay=-1"),
        (lambda: co2jax.delayed_diloco(NESTEROV, delay=1.5), "delay=1.5"),
        (lambda: co2jax.eager_diloco(NESTEROV, delay=0), "delay=0"),
        (lambda: co2jax.eager_diloco(NESTEROV, num_replicas=0), "num_replicas=0"),
        (lambda: co2jax.slowmo(0.0), "inner_learning_rate=0.0"),
        (lambda: co2jax.slowmo(0.1, slow_learning_rate=-1), "slow_learning_rate=-1"),
        (lambda: co2jax.slowmo(0.1, slow_momentum=1.0), "slow_momentum=1.0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 0), "sync_every=0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 2.0), "sync_every=2.0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), NESTEROV, 2), "outer="),
        (lambda: co2jax.local_updates("adam", co2jax.local_sgd(), 2), "inner='adam'"),
        (lambda: co2jax.data_parallel(None), "inner=None"),
        (lambda: co2jax.local_sgd(axis_name=""), "axis_name=''"),
        (lambda: penalties.constant(0.0), "lam=0.0"),
        (lambda: penalties.gap_aware(decay=1.0), "decay=1.0"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_reference_code_mode_warns_that_clip_is_ignored():
    with pytest.warns(UserWarning, match="no-op"):
        outer = co2jax.co2(1.0, 0.5, clip_threshold=1.0, mode="reference_code")
    assert not outer.overlapped  # the released code averages synchronously


@pytest.mark.parametrize(
    "outer",
    [co2jax.local_sgd(), co2jax.co2(1.0, 0.5), co2jax.eager_diloco(NESTEROV)],
    ids=["local_sgd", "co2", "eager"],
)
def test_sync_outside_the_replica_axis_says_how_to_run_it(outer):
    params = jnp.zeros(3)
    with pytest.raises(NameError, match=r"jax\.vmap\(fn, axis_name='replica'\).*shard_map"):
        outer.sync(params, outer.init(params))


def test_data_parallel_outside_the_replica_axis():
    opt = co2jax.data_parallel(optax.sgd(0.1))
    with pytest.raises(NameError, match="replica"):
        opt.update(jnp.ones(2), opt.init(jnp.ones(2)), jnp.ones(2))


def test_adapter_without_params():
    tx = co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 2)
    with pytest.raises(ValueError, match="params"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))
