"""The algorithms through the fused outer update, against their numpy textbook loops.

Each fusable algorithm runs three ways: ``unfused`` (the optax transform stripped of its
description, so the generic per-leaf path runs: the slow twin), ``xla`` (the fused update's
jnp reference) and ``interpret`` (the Pallas kernel in Pallas' interpreter), under
``jax.vmap`` and under ``shard_map`` on the emulated mesh.
"""

from __future__ import annotations

import harness
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_algorithms import CASES, LR, NESTEROV, ROUNDS, H

import co2jax
from co2jax import penalties
from co2jax.algorithms.co2 import scale_by_co2_momentum

TEXTBOOK = {c.name: c.textbook for c in CASES}


def _nesterov():
    return co2jax.outer_sgd(NESTEROV["eta"], momentum=NESTEROV["mu"], nesterov=True)


FUSABLE = {
    # name in test_algorithms.CASES: (transform, delay, eager)
    "local_sgd": (lambda: co2jax.outer_sgd(1.0), 0, False),
    "diloco": (_nesterov, 0, False),
    "delayed_diloco": (_nesterov, 1, False),
    "delayed_diloco_2": (_nesterov, 2, False),
    "eager_diloco": (_nesterov, 1, True),
    "eager_diloco_2": (_nesterov, 2, True),
    "co2": (lambda: scale_by_co2_momentum(1.0, 0.5), 1, False),
    "co2_clip": (lambda: scale_by_co2_momentum(1.0, 0.5, 0.1), 1, False),
    "co2_gap_aware": (
        lambda: scale_by_co2_momentum(0.8, 0.5, penalty=penalties.gap_aware(decay=0.9)),
        1,
        False,
    ),
    "co2_reference_code": (
        lambda: scale_by_co2_momentum(1.0, 0.5, penalty=penalties.constant(2.0)),
        0,
        False,
    ),
}
IMPLEMENTATIONS = ["unfused", "xla", "interpret"]


def _make(name, implementation):
    transform, delay, eager = FUSABLE[name]
    tx = transform()
    assert tx.fusable is not None
    if implementation == "unfused":
        tx = optax.GradientTransformation(tx.init, tx.update)
    return co2jax.pseudo_gradient_method(
        tx,
        delay=delay,
        eager=eager,
        implementation="xla" if implementation == "unfused" else implementation,
    )


@pytest.fixture(scope="module")
def problem():
    import textbook as tb

    return tb.make_problem(replicas=4, examples=2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(FUSABLE))
@pytest.mark.cases("first", 10)
def test_vmap_matches_textbook(name, implementation, problem):
    expected = TEXTBOOK[name](problem)
    got, _ = harness.run_vmap(_make(name, implementation), problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, expected, **harness.TOL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(FUSABLE))
@pytest.mark.cases("first", 10)
def test_shard_map_matches_textbook(name, implementation, problem):
    mesh = harness.make_mesh(replica=4, data=2)
    expected = TEXTBOOK[name](problem)
    # Pallas' interpreter is not typed for shard_map's varying-axis check (STYLE.md)
    got, _ = harness.run_shard_map(
        _make(name, implementation),
        problem,
        LR,
        H,
        ROUNDS,
        mesh,
        check_vma=implementation != "interpret",
    )
    np.testing.assert_allclose(got, expected, **harness.TOL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("name", ["co2_gap_aware", "eager_diloco", "co2_reference_code"])
@pytest.mark.cases("each")
def test_fused_state_equals_the_unfused_state(name, implementation, problem):
    """Same outer state (momentum, penalty average and count, penalty scale, pending)."""
    _, want = harness.run_vmap(_make(name, "unfused"), problem, LR, H, ROUNDS)
    _, got = harness.run_vmap(_make(name, implementation), problem, LR, H, ROUNDS)
    import jax

    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6
        ),
        got,
        want,
    )


def test_factories_take_an_implementation(problem):
    for outer in (
        co2jax.co2(1.0, 0.5, implementation="interpret"),
        co2jax.diloco(_nesterov(), implementation="interpret"),
        co2jax.delayed_diloco(_nesterov(), implementation="interpret"),
        co2jax.eager_diloco(_nesterov(), implementation="interpret"),
    ):
        assert outer.accepts_gathered
    with pytest.raises(ValueError, match="implementation"):
        co2jax.co2(1.0, 0.5, implementation="cuda")
