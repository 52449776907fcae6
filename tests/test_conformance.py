"""The conformance list: every algorithm of the registry inherits these checks, plus a few
factory variants. Adding an algorithm to the registry (with its textbook entry) adds it here."""

from __future__ import annotations

from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax import penalties
from co2jax.algorithms import registry

H = tb.REGISTERED_H
DOCS = Path(__file__).resolve().parents[1] / "docs" / "algorithms"


def _problem(seed=7, dim=16):
    return tb.make_problem(replicas=4, examples=2, dim=dim, seed=seed)


def _registered(name):
    return lambda problem, lr: harness.registered(name, problem, lr, H)


def _variant(make):
    return lambda problem, lr: (make(), optax.sgd(lr))


ALGORITHMS = {name: _registered(name) for name in (*registry.NAMES, *tb.VARIANTS)}
ALGORITHMS.update(
    {
        "co2_gap_aware": _variant(lambda: co2jax.co2(1.0, 0.2, penalty=penalties.gap_aware())),
        "co2_reference_code": _variant(lambda: co2jax.co2(1.0, 0.5, mode="reference_code")),
        "skip_nonfinite(delayed_diloco)": _variant(
            lambda: co2jax.skip_nonfinite(
                co2jax.delayed_diloco(optax.sgd(0.5, momentum=0.5, nesterov=True))
            )
        ),
        "error_feedback(diloco int8)": _variant(
            lambda: co2jax.error_feedback(
                co2jax.diloco(
                    optax.sgd(0.7, momentum=0.9, nesterov=True),
                    reduce=co2jax.comm.all_gather_compressed(co2jax.comm.int8(block=8)),
                )
            )
        ),
    }
)
NAMES = list(ALGORITHMS)
TOPK = {
    "sparseloco",
    "sparseloco[production]",
    "dct_diloco",
    "demo",
}  # payloads chosen by top-k magnitude
# The released DCT-momentum DiLoCo steps each replica's anchor by its own pseudo-gradient plus
# the shared momentum (docs/algorithms/dct_diloco.md): on this strongly heterogeneous problem
# the replica-local anchors settle apart, short of the mean objective's optimum.
# SparseLoCo's production aggregation (the mean over contributors, each replica clipped to the
# median norm) weights replicas unevenly: on this problem it stops 8% of the gap short (the
# paper's 1/R average, outer.average=replicas: 1.2%; docs/algorithms/sparseloco.md).
SETTLES_APART = {"dct_diloco": 0.15, "sparseloco[production]": 0.1}
SIGN_STEPS = {"demo"}  # updates are -lr * sign(u)


def test_every_registered_algorithm_has_its_textbook_loop_and_page():
    assert set(tb.REGISTERED) == set(registry.NAMES)
    missing = [name for name in registry.NAMES if not (DOCS / f"{name}.md").exists()]
    assert missing == []


def _global_loss(problem, theta):
    return np.mean(
        [
            np.mean(0.5 * np.sum(problem.d[r] * (theta - problem.c[r]) ** 2, axis=-1))
            for r in range(problem.replicas)
        ]
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.cases("first", 7)
def test_converges_on_heterogeneous_quadratic(name):
    problem = _problem()
    outer, inner = ALGORITHMS[name](problem, 0.1)
    got, _ = harness.run_rounds(outer, problem, 0.1, H, 40, inner=inner)
    # The optimum of the mean objective, in closed form.
    cbar = problem.c.mean(axis=1)
    optimum = (problem.d * cbar).sum(0) / problem.d.sum(0)
    best = _global_loss(problem, optimum)
    start = _global_loss(problem, problem.theta0)
    final = _global_loss(problem, got[-1].mean(axis=0))
    assert final - best < SETTLES_APART.get(name, 0.05) * (start - best), (name, start, final, best)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.cases("first", 3)
def test_bf16_stays_bf16(name):
    problem = _problem(seed=8)
    outer, inner = ALGORITHMS[name](problem, 0.1)
    got_bf16, state = harness.run_rounds(outer, problem, 0.1, H, 3, jnp.bfloat16, inner)
    init_state = jax.vmap(outer.init)(harness.initial_params(problem, jnp.bfloat16))
    dtypes = lambda s: [x.dtype for x in jax.tree.leaves(s)]
    assert dtypes(state) == dtypes(init_state)
    if jax.tree.leaves(init_state):  # DDP's outer state is empty
        assert jnp.dtype(jnp.bfloat16) in dtypes(state)
    outer, inner = ALGORITHMS[name](problem, 0.1)
    got_f32, _ = harness.run_rounds(outer, problem, 0.1, H, 3, inner=inner)
    if name in SIGN_STEPS:
        # sign steps of +-lr: a coordinate whose sign rounds the other way in bfloat16 moves
        # the other way; compare how far each run got on the objective instead
        start = _global_loss(problem, problem.theta0)
        f32, bf16 = (_global_loss(problem, g[-1].mean(0)) for g in (got_f32, got_bf16))
        assert abs(bf16 - f32) < 0.1 * (start - f32), (start, f32, bf16)
    elif name in TOPK:
        # top-k of bfloat16 magnitudes selects another index where two round together: that
        # element moves by a whole step; the others stay within the bf16 tolerance
        close = np.isclose(got_bf16, got_f32, rtol=5e-2, atol=5e-2)
        assert close.mean() > 0.9, close.mean()
    else:
        np.testing.assert_allclose(got_bf16, got_f32, rtol=5e-2, atol=5e-2)  # 12 bf16 steps


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.cases("first", 5)
def test_state_types_stable_under_jit(name):
    """Through the per-step adapter (every schedule runs there): one compiled step for sync
    and non-sync steps, and the state keeps its types across rounds."""
    problem = _problem()
    outer, inner = ALGORITHMS[name](problem, 0.1)
    tx = co2jax.local_updates(inner, outer, H)
    params = harness.initial_params(problem)
    state = jax.vmap(tx.init)(params)
    step = harness.vmap_step(tx)
    d, c = jnp.asarray(problem.d), jnp.asarray(problem.c)
    types = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype, type(x)), s)
    new_params, new_state = params, state
    for _ in range(2 * H + 1):
        new_params, new_state = step(new_params, new_state, d, c)
    assert type(new_state.outer_state) is type(state.outer_state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert types(new_state) == types(state)
    assert types(new_params) == types(params)
    assert step._cache_size() == 1


@pytest.mark.parametrize("name", NAMES)
def test_abstract_init(name):
    problem = _problem()
    outer, _ = ALGORITHMS[name](problem, 0.1)
    params = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    params["w"] = params["w"].astype(jnp.bfloat16)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shapes = jax.eval_shape(outer.init, abstract)
    concrete = outer.init(params)
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(shapes), jax.tree.leaves(concrete), strict=True):
        assert (a.shape, a.dtype) == (c.shape, c.dtype)
