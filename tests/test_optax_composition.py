"""Outer hyper-parameters as optax schedules and under optax.inject_hyperparams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import co2jax

R, ROUNDS = 3, 6


def _rounds(outer, seed=0):
    """ROUNDS syncs of R replicas that each move by a fixed random step per round."""
    rng = np.random.default_rng(seed)
    steps = jnp.asarray(rng.normal(size=(ROUNDS, R, 4)), jnp.float32)
    params = jnp.zeros((R, 4))
    state = jax.vmap(outer.init)(params)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    out = []
    for t in range(ROUNDS):
        params, state = sync(params + steps[t], state)
        out.append(np.asarray(params))
    return np.stack(out), state, np.asarray(steps, np.float64)


def _textbook(steps, alpha, beta):
    """CO2 (paper mode, no clip, no penalty): at round t >= 1, outer step s = t - 1:
    m <- beta(s) m + Delta-bar^(t-1), theta <- theta - alpha(s) m. Round 0 has no average
    yet and takes no outer step (the schedules count outer steps)."""
    theta, m, stale, out = np.zeros(4), np.zeros(4), None, []
    for t in range(len(steps)):
        if stale is not None:
            s = t - 1
            m = beta(s) * m + stale
            theta = theta - alpha(s) * m
        stale = -steps[t].mean(axis=0)  # Delta = anchor - local: minus the step
        out.append(np.broadcast_to(theta, (R, 4)))
    return np.stack(out)


def test_a_constant_schedule_equals_the_number():
    fixed, *_ = _rounds(co2jax.co2(0.7, 0.5, implementation="xla"))
    scheduled, *_ = _rounds(co2jax.co2(optax.constant_schedule(0.7), 0.5))
    np.testing.assert_array_equal(scheduled, fixed)


def test_schedules_follow_the_outer_step_count():
    alpha = optax.linear_schedule(1.0, 0.2, ROUNDS)
    beta = optax.piecewise_constant_schedule(0.5, {3: 0.0})
    got, state, steps = _rounds(co2jax.co2(alpha, beta))
    want = _textbook(steps, lambda t: float(alpha(t)), lambda t: float(beta(t)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the first sync has no average to apply: no outer step, the schedules wait
    assert int(np.asarray(state.outer_state.count)[0]) == ROUNDS - 1


def test_inject_hyperparams_is_co2_and_tunable_at_run_time():
    make = optax.inject_hyperparams(co2jax.scale_by_co2_momentum)
    injected = co2jax.delayed_diloco(make(learning_rate=0.7, momentum=0.5))
    got, state, _ = _rounds(injected)
    want, *_ = _rounds(co2jax.co2(0.7, 0.5, implementation="xla"))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    hyper = state.outer_state.hyperparams
    np.testing.assert_allclose(hyper["learning_rate"], [0.7] * R)
    # set at run time: a zero learning rate freezes the anchor at the next sync
    hyper["learning_rate"] = jnp.zeros(R)
    params = jnp.asarray(got[-1])
    moved, _ = jax.vmap(injected.sync, axis_name="replica")(params + 1.0, state)
    np.testing.assert_array_equal(moved, params)


def test_a_bad_schedule_is_refused_up_front():
    with pytest.raises(ValueError, match=r"learning_rate \(a schedule, at outer step 0\)"):
        co2jax.co2(optax.constant_schedule(-1.0), 0.5)
    with pytest.raises(ValueError, match=r"momentum \(a schedule, at outer step 0\)"):
        co2jax.co2(0.7, optax.constant_schedule(1.5))
