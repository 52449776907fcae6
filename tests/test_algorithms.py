"""Every algorithm against its numpy textbook loop: under jax.vmap and under jax.shard_map."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from jax.sharding import AxisType

import co2jax
from co2jax import penalties

LR, H, ROUNDS = 0.1, 3, 5
NESTEROV = dict(eta=0.7, mu=0.9)


def _gamma(t):
    return 0.1 / (1.0 + t)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], co2jax.OuterOptimizer]
    textbook: Callable[[tb.Problem], np.ndarray]


def _nesterov():
    return optax.sgd(NESTEROV["eta"], momentum=NESTEROV["mu"], nesterov=True)


def _directional(anchor, prev, delta):
    """A CO2 penalty sensitive to the sign of previous anchor - anchor (jnp)."""
    return jax.tree.map(lambda a, b: 1.0 + 0.5 * jnp.tanh(10.0 * (b - a)), anchor, prev)


def _directional_np(a, b):
    """:func:`_directional` for the textbook loop."""
    return 1.0 + 0.5 * np.tanh(10.0 * (b - a))


CASES = [
    Case("local_sgd", co2jax.local_sgd, lambda p: tb.local_sgd(p, LR, H, ROUNDS)),
    Case(
        "diloco",
        lambda: co2jax.diloco(_nesterov()),
        lambda p: tb.diloco_nesterov(p, LR, H, ROUNDS, **NESTEROV),
    ),
    Case(
        "delayed_diloco",
        lambda: co2jax.delayed_diloco(_nesterov(), delay=1),
        lambda p: tb.diloco_nesterov(p, LR, H, ROUNDS, **NESTEROV, delay=1),
    ),
    Case(
        "delayed_diloco_2",
        lambda: co2jax.delayed_diloco(_nesterov(), delay=2),
        lambda p: tb.diloco_nesterov(p, LR, H, ROUNDS, **NESTEROV, delay=2),
    ),
    Case(
        "eager_diloco",
        lambda: co2jax.eager_diloco(_nesterov()),
        lambda p: tb.eager_nesterov(p, LR, H, ROUNDS, **NESTEROV),
    ),
    Case(
        "eager_diloco_2",
        lambda: co2jax.eager_diloco(_nesterov(), delay=2),
        lambda p: tb.eager_nesterov(p, LR, H, ROUNDS, **NESTEROV, delay=2),
    ),
    Case(
        "slowmo",
        lambda: co2jax.slowmo(_gamma, slow_learning_rate=0.9, slow_momentum=0.6),
        lambda p: tb.slowmo(p, LR, H, ROUNDS, _gamma, alpha=0.9, beta=0.6),
    ),
    Case(
        "co2",
        lambda: co2jax.co2(learning_rate=1.0, momentum=0.5),
        lambda p: tb.co2_paper(p, LR, H, ROUNDS, alpha=1.0, beta=0.5),
    ),
    Case(
        "co2_clip",
        lambda: co2jax.co2(learning_rate=1.0, momentum=0.5, clip_threshold=0.1),
        lambda p: tb.co2_paper(p, LR, H, ROUNDS, alpha=1.0, beta=0.5, phi=0.1),
    ),
    Case(
        "co2_gap_aware",
        lambda: co2jax.co2(0.8, 0.5, penalty=penalties.gap_aware(decay=0.9)),
        lambda p: tb.co2_paper(
            p, LR, H, ROUNDS, alpha=0.8, beta=0.5, penalty=tb.gap_aware_penalty(0.9)
        ),
    ),
    Case(
        "co2_callable_penalty",
        lambda: co2jax.co2(1.0, 0.3, penalty=lambda anchor, prev, delta: 0.5),
        lambda p: tb.co2_paper(p, LR, H, ROUNDS, alpha=1.0, beta=0.3, penalty=lambda a, b: 0.5),
    ),
    Case(
        # sign-sensitive in previous_anchor - anchor: pins which anchor is "previous"
        "co2_directional_penalty",
        lambda: co2jax.co2(1.0, 0.5, penalty=_directional),
        lambda p: tb.co2_paper(p, LR, H, ROUNDS, alpha=1.0, beta=0.5, penalty=_directional_np),
    ),
    Case(
        "co2_reference_code",
        lambda: co2jax.co2(1.0, 0.5, penalty=penalties.constant(2.0), mode="reference_code"),
        lambda p: tb.co2_reference_code(p, LR, H, ROUNDS, alpha=1.0, beta=0.5, lam=2.0),
    ),
    Case(
        # a callable penalty keeps the update off the fused kernel: the clip of the optax
        # transform itself (the fused one is "co2_clip"'s)
        "co2_clip_unfused",
        lambda: co2jax.co2(1.0, 0.5, clip_threshold=0.1, penalty=lambda a, prev, d: 0.8),
        lambda p: tb.co2_paper(
            p, LR, H, ROUNDS, alpha=1.0, beta=0.5, phi=0.1, penalty=lambda a, b: 0.8
        ),
    ),
    Case(
        # a scheduled learning rate: the previous anchor the penalty sees is the current one
        # plus the *last* step's alpha times m (alpha at the step before, not this one)
        "co2_scheduled_directional",
        lambda: co2jax.co2(lambda t: 1.0 / (1.0 + t), 0.5, penalty=_directional),
        lambda p: tb.co2_paper(
            p, LR, H, ROUNDS, alpha=lambda t: 1.0 / (1.0 + t), beta=0.5, penalty=_directional_np
        ),
    ),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 11)
def test_vmap_matches_textbook(case, problem):
    expected = case.textbook(problem)
    got, _ = harness.run_vmap(case.make(), problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, expected, **harness.TOL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("each")
def test_shard_map_matches_textbook(case, axis_type, problem):
    mesh = harness.make_mesh(replica=4, data=2, axis_type=axis_type)
    expected = case.textbook(problem)
    got, _ = harness.run_shard_map(case.make(), problem, LR, H, ROUNDS, mesh)
    np.testing.assert_allclose(got, expected, **harness.TOL[jnp.dtype(jnp.float32)])


def test_textbook_clip_binds(problem):
    """The clipped case must differ from the unclipped one, or it proves nothing."""
    clipped = tb.co2_paper(problem, LR, H, ROUNDS, alpha=1.0, beta=0.5, phi=0.1)
    free = tb.co2_paper(problem, LR, H, ROUNDS, alpha=1.0, beta=0.5)
    assert np.abs(clipped - free).max() > 0.05
    # and every step it takes is within phi (alpha = 1)
    steps = np.abs(np.diff(clipped[:, 0], axis=0))
    assert steps.max() <= 0.1 + 1e-12


def test_gap_aware_penalty_is_active(problem):
    with_penalty = tb.co2_paper(
        problem, LR, H, ROUNDS, alpha=0.8, beta=0.5, penalty=tb.gap_aware_penalty(0.9)
    )
    without = tb.co2_paper(problem, LR, H, ROUNDS, alpha=0.8, beta=0.5)
    assert np.abs(with_penalty - without).max() > 1e-2


def test_data_parallel_matches_textbook(problem):
    opt = co2jax.data_parallel(optax.sgd(LR))
    got, *_ = harness.run_vmap_steps(opt, problem, ROUNDS * H, every=H)
    expected = tb.data_parallel_sgd(problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, expected, **harness.TOL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize(
    "penalty, want",
    [(None, 1.0), (penalties.constant(2.0), 0.5), (lambda a, p, d: 0.25, 0.25)],
    ids=["none", "constant", "callable"],
)
def test_co2_records_its_penalty_scale(penalty, want):
    outer = co2jax.co2(1.0, 0.5, penalty=penalty)
    state = jax.vmap(outer.init)(jnp.zeros((2, 3)))
    sync = jax.vmap(outer.sync, axis_name="replica")
    for _ in range(2):  # the first real average arrives at the second sync
        _, state = sync(jnp.array([[1.0], [3.0]]) * jnp.ones((2, 3)), state)
    np.testing.assert_allclose(state.outer_state.penalty_scale, [want, want])


def test_gap_aware_penalty_scale_is_below_one_once_the_anchor_moves():
    outer = co2jax.co2(1.0, 0.5, penalty=penalties.gap_aware(decay=0.5))
    state = jax.vmap(outer.init)(jnp.zeros((2, 3)))
    sync = jax.vmap(outer.sync, axis_name="replica")
    params = jnp.zeros((2, 3))
    for _ in range(5):
        params, state = sync(params + jnp.array([[1.0], [3.0]]), state)
    scale = np.asarray(state.outer_state.penalty_scale)
    assert np.all((scale > 0) & (scale < 1)), scale
