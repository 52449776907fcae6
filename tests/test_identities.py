"""Degenerate identities between algorithms, and the sign of the outer step."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from test_algorithms import CASES, IDS

import co2jax
from co2jax import penalties

LR, H, ROUNDS = 0.1, 3, 5
TOL = harness.TOL[jnp.dtype(jnp.float32)]


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, seed=1)


def _run(outer, problem, H=H, rounds=ROUNDS):
    return harness.run_vmap(outer, problem, LR, H, rounds)[0]


def test_diloco_with_sgd_1_is_local_sgd(problem):
    np.testing.assert_allclose(
        _run(co2jax.diloco(optax.sgd(1.0)), problem), _run(co2jax.local_sgd(), problem), **TOL
    )


def test_co2_reference_code_momentum_0_lr_1_is_local_sgd(problem):
    co2 = co2jax.co2(1.0, 0.0, penalty=penalties.constant(1.0), mode="reference_code")
    np.testing.assert_allclose(_run(co2, problem), _run(co2jax.local_sgd(), problem), **TOL)


def test_co2_paper_momentum_0_lr_1_is_delayed_local_sgd(problem):
    np.testing.assert_allclose(
        _run(co2jax.co2(1.0, 0.0), problem),
        _run(co2jax.delayed_diloco(optax.sgd(1.0), delay=1), problem),
        **TOL,
    )


def test_slowmo_constant_gamma_is_diloco_heavy_ball(problem):
    np.testing.assert_allclose(
        _run(co2jax.slowmo(0.05, slow_learning_rate=0.8, slow_momentum=0.6), problem),
        _run(co2jax.diloco(optax.sgd(0.8, momentum=0.6)), problem),
        **TOL,
    )


def test_slowmo_beta_0_alpha_1_is_local_sgd(problem):
    np.testing.assert_allclose(
        _run(co2jax.slowmo(0.05, slow_learning_rate=1.0, slow_momentum=0.0), problem),
        _run(co2jax.local_sgd(), problem),
        **TOL,
    )


def test_delayed_diloco_delay_0_is_diloco(problem):
    outer = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)
    np.testing.assert_allclose(
        _run(co2jax.delayed_diloco(outer(), delay=0), problem),
        _run(co2jax.diloco(outer()), problem),
        **TOL,
    )


def test_h1_local_sgd_is_data_parallel_sgd(problem):
    """One inner SGD step per round, then averaging, is synchronous SGD on the mean gradient."""
    got = _run(co2jax.local_sgd(), problem, H=1, rounds=6)
    expected = tb.data_parallel_sgd(problem, LR, 1, 6)
    np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 9)
def test_single_replica_is_plain_training(case):
    """R = 1 with a plain SGD outer step of 1 is plain training; others match their textbook."""
    problem = tb.make_problem(replicas=1, examples=2, seed=2)
    got = _run(case.make(), problem)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)
    if case.name in ("local_sgd",):
        plain = problem.theta0.copy()
        for _ in range(ROUNDS * H):
            plain = plain - LR * problem.grad(0, plain)
        np.testing.assert_allclose(got[-1, 0], plain, **TOL)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_anchor_moves_toward_replicas(case):
    """Each round replica r ends at anchor + v_r; the anchor must move along mean_r v_r."""
    R, dim, rounds = 4, 5, 4
    rng = np.random.default_rng(3)
    offsets = jnp.asarray(rng.normal(size=(R, dim)) * 0.1 + 0.05, jnp.float32)
    outer = case.make()
    start = jnp.zeros((R, dim), jnp.float32)
    state = jax.vmap(outer.init)(start)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    params = start
    for _ in range(rounds):
        params, state = sync(params + offsets, state)
    moved = np.asarray(params).mean(axis=0)
    assert float(moved @ np.asarray(offsets.mean(axis=0))) > 0, case.name


def test_delayed_outer_optimizer_is_not_stepped_before_the_first_average():
    """With delay d, the first d syncs leave the anchor and the outer state untouched.

    Stepping Adam on a zero "gradient" would still advance its count (bias correction), and
    AdamW's decoupled weight decay would move the anchor.
    """
    outer = co2jax.delayed_diloco(optax.adamw(0.1, weight_decay=0.5), delay=2)
    start = jnp.ones((2, 3))
    state = jax.vmap(outer.init)(start)
    init_state = state
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    for _ in range(2):
        params, state = sync(start + jnp.array([[1.0], [3.0]]), state)
        np.testing.assert_array_equal(params, start)
        for a, b in zip(
            jax.tree.leaves(state.outer_state), jax.tree.leaves(init_state.outer_state), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    params, state = sync(start + jnp.array([[1.0], [3.0]]), state)
    assert not np.array_equal(np.asarray(params), np.asarray(start))  # the first average arrived
    np.testing.assert_array_equal(state.count, [3, 3])
