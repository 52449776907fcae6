"""The conformance list: every algorithm inherits these checks. Adding one is one line."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax import penalties

ALGORITHMS = {
    "local_sgd": lambda: co2jax.local_sgd(),
    "diloco": lambda: co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)),
    "delayed_diloco": lambda: co2jax.delayed_diloco(optax.sgd(0.5, momentum=0.5, nesterov=True)),
    "eager_diloco": lambda: co2jax.eager_diloco(optax.sgd(0.7, momentum=0.5, nesterov=True)),
    "slowmo": lambda: co2jax.slowmo(0.1, slow_learning_rate=1.0, slow_momentum=0.5),
    # a one-round-stale step with heavy momentum oscillates: keep beta small (as the released
    # code does for few replicas)
    "co2": lambda: co2jax.co2(1.0, 0.2, clip_threshold=1.0),
    "co2_gap_aware": lambda: co2jax.co2(1.0, 0.2, penalty=penalties.gap_aware()),
    "co2_reference_code": lambda: co2jax.co2(1.0, 0.5, mode="reference_code"),
    "skip_nonfinite(co2)": lambda: co2jax.skip_nonfinite(co2jax.co2(1.0, 0.2)),
    "skip_nonfinite(delayed_diloco)": lambda: co2jax.skip_nonfinite(
        co2jax.delayed_diloco(optax.sgd(0.5, momentum=0.5, nesterov=True))
    ),
}
NAMES = list(ALGORITHMS)


def _global_loss(problem, theta):
    return np.mean(
        [
            np.mean(0.5 * np.sum(problem.d[r] * (theta - problem.c[r]) ** 2, axis=-1))
            for r in range(problem.replicas)
        ]
    )


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_heterogeneous_quadratic(name):
    problem = tb.make_problem(replicas=4, examples=2, seed=7)
    got, _ = harness.run_vmap(ALGORITHMS[name](), problem, 0.1, 5, 40)
    # The optimum of the mean objective, in closed form.
    cbar = problem.c.mean(axis=1)
    optimum = (problem.d * cbar).sum(0) / problem.d.sum(0)
    best = _global_loss(problem, optimum)
    start = _global_loss(problem, problem.theta0)
    final = _global_loss(problem, got[-1].mean(axis=0))
    assert final - best < 0.05 * (start - best), (name, start, final, best)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_stays_bf16(name):
    problem = tb.make_problem(seed=8)
    outer = ALGORITHMS[name]()
    got_bf16, state = harness.run_vmap(outer, problem, 0.1, 3, 3, dtype=jnp.bfloat16)
    init_state = jax.vmap(outer.init)(harness.initial_params(problem, jnp.bfloat16))
    dtypes = lambda s: [x.dtype for x in jax.tree.leaves(s)]
    assert dtypes(state) == dtypes(init_state)
    assert jnp.dtype(jnp.bfloat16) in dtypes(state)
    got_f32, _ = harness.run_vmap(ALGORITHMS[name](), problem, 0.1, 3, 3)
    np.testing.assert_allclose(got_bf16, got_f32, rtol=5e-2, atol=5e-2)  # 9 bf16 steps


@pytest.mark.parametrize("name", NAMES)
def test_state_types_stable_under_jit(name):
    outer = ALGORITHMS[name]()
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((4, 2))}
    state = jax.vmap(outer.init)(params)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    types = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype, type(x)), s)
    local = jax.tree.map(lambda x: x + jnp.arange(4.0).reshape(4, *([1] * (x.ndim - 1))), params)
    new_params, new_state = sync(local, state)
    for _ in range(2):
        new_params, new_state = sync(jax.tree.map(lambda x: x + 0.1, new_params), new_state)
    assert type(new_state) is type(state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert types(new_state) == types(state)
    assert types(new_params) == types(params)
    assert sync._cache_size() == 1


@pytest.mark.parametrize("name", NAMES)
def test_abstract_init(name):
    outer = ALGORITHMS[name]()
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros((2,), jnp.float32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shapes = jax.eval_shape(outer.init, abstract)
    concrete = outer.init(params)
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(shapes), jax.tree.leaves(concrete), strict=True):
        assert (a.shape, a.dtype) == (c.shape, c.dtype)
