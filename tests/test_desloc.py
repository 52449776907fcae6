"""DES-LOC (docs/algorithms/desloc.md): the special cases, periods that are not multiples of
the round, what is sent and when, and the settings. Every driver and layout against the numpy
loop: tests/test_matrix.py (``desloc``, Adam inside)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from textbook_desloc import desloc_adam

import co2jax
from co2jax.algorithms import registry
from co2jax.algorithms.desloc import desloc_step_bytes, moment_fields
from co2jax.comm.reducer import ring_bytes

LR, H, ROUNDS = 0.1, 4, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]
ADAM = dict(b1=0.9, b2=0.95)  # float32-safe bias correction (tests/harness.py::INNER)


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, dim=16, seed=2)


def _run(problem, inner, H=H, rounds=ROUNDS):
    return harness.run_rounds(co2jax.local_sgd(), problem, LR, H, rounds, inner=inner)[0]


@pytest.mark.parametrize("first,second", [(3, 5), (1, 0), (0, 6), (0, 0)])
def test_periods_that_are_not_multiples_of_the_round_match_the_loop(problem, first, second):
    inner = co2jax.desloc(optax.adam(LR, **ADAM), first, second)
    want = desloc_adam(problem, LR, H, ROUNDS, first, second, **ADAM)
    np.testing.assert_allclose(_run(problem, inner), want, **TOL)


def test_the_moments_change_the_trajectory(problem):
    """Averaging the moments is not Local Adam (the loop above can fail)."""
    never = desloc_adam(problem, LR, H, ROUNDS, 0, 0, **ADAM)
    often = desloc_adam(problem, LR, H, ROUNDS, 1, 2, **ADAM)
    assert np.abs(never - often).max() > 1e-3


def test_the_round_engine_with_periods_across_rounds(problem):
    """K_u = 3, K_v = 5 steps at H = 4 on the 4 x 2 mesh: the count crosses rounds."""
    mesh = harness.make_mesh(4, 2)
    from test_engine import engine_loss, textbook_batch

    inner = co2jax.desloc(optax.adam(LR, **ADAM), 3, 5)
    trainer = co2jax.RoundTrainer(engine_loss, inner, co2jax.local_sgd(), mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    got = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        got.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    want = desloc_adam(problem, LR, H, ROUNDS, 3, 5, **ADAM)
    np.testing.assert_allclose(np.stack(got), want, **TOL)


def test_one_replica_is_adamw():
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=3)
    adamw = optax.adamw(LR, weight_decay=0.1)
    got = _run(problem, co2jax.desloc(optax.adamw(LR, weight_decay=0.1), 1, 2))
    alone = _run(problem, adamw)
    np.testing.assert_array_equal(got, alone)


def test_heavy_ball_averaged_every_step_is_ddp_with_momentum(problem):
    """K_x = K_u = 1 with SGD momentum: every replica takes the mean step (the trace is
    linear in the gradients)."""
    mu = 0.5
    got = _run(problem, co2jax.desloc(optax.sgd(LR, momentum=mu), 1, 0), H=1, rounds=8)
    theta, trace, want = problem.theta0.copy(), 0.0, []
    for _ in range(8):
        g = np.mean([problem.grad(r, theta) for r in range(problem.replicas)], axis=0)
        trace = g + mu * trace
        theta = theta - LR * trace
        want.append(np.stack([theta] * problem.replicas))
    np.testing.assert_allclose(got, np.array(want), **TOL)


def test_the_moments_are_found_through_chains_and_injected_hyper_parameters():
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=LR),
    )
    assert moment_fields(inner.init({"w": jnp.zeros(3)})) == (["mu"], ["nu"])
    assert moment_fields(optax.sgd(LR, momentum=0.9).init(jnp.zeros(3))) == (["trace"], [])


def test_the_moments_are_averaged_only_inside_conds():
    """No collective on a step where nothing is due: every all-reduce of the update is in a
    branch of a cond on the step count."""
    tx = co2jax.desloc(optax.adam(LR), 3, 6)
    params = jnp.zeros(5)
    state = tx.init(params)
    # one replica's update with the axis bound, as in the round engine (no vmap: under
    # vmap a cond on a batched count becomes a select of both branches)
    jaxpr = jax.make_jaxpr(tx.update, axis_env=[("replica", 2)])(params, state, params).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]
    assert not any(name.startswith("psum") for name in top)
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 2  # first moments, second moments
    for cond in conds:
        reduced = [str(b).count("psum") for b in cond.params["branches"]]
        assert sorted(reduced) == [0, 1]  # one branch averages, the other sends nothing


def test_half_the_traffic_of_local_adam():
    """Per K_x steps: parameters once, m a third, v a sixth of the time (1.5 copies) against
    Local Adam's three copies (every state every K_x)."""
    params = {"b": jnp.zeros(2), "w": jnp.zeros((3, 5))}
    copy = ring_bytes(4 * 17, 4)
    desloc = copy + H * desloc_step_bytes(params, 4, 3 * H, 6 * H)
    local_adam = copy + H * desloc_step_bytes(params, 4, H, H)
    assert desloc == pytest.approx(1.5 * copy)
    assert desloc / local_adam == pytest.approx(0.5)
    s = registry.settings("desloc")
    assert s.step_bytes(params, 4, H) == pytest.approx(desloc_step_bytes(params, 4, 3 * H, 6 * H))


def test_an_inner_transform_without_moments_is_refused():
    tx = co2jax.desloc(optax.sgd(LR), 3, 6)
    with pytest.raises(ValueError, match="keeps none") as info:
        tx.init(jnp.zeros(3))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"first_moment_every": -1}, r"outer.first_moment_every=-1: must be >= 0"),
        ({"second_moment_every": -2}, r"outer.second_moment_every=-2: must be >= 0"),
        ({"learning_rate": 0.7}, r"outer.learning_rate=0.7: desloc has no such setting"),
    ],
)
def test_bad_settings_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match):
        registry.settings("desloc", **fields).validate()


def test_the_registry_needs_the_round_length():
    s = registry.settings("desloc")
    with pytest.raises(ValueError, match="needs the round length"):
        s.inner(optax.adam(LR), registry.Context(None, inner_learning_rate=LR))
