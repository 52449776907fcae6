"""A poisoned replica (a NaN in its batch) restarts from the anchor and takes part again in
the next round (co2jax.engines.recovery), in the round engine, against numpy textbook loops.
The multi-job case is in test_fault_tolerance.py."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_masked as tm
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax.algorithms import registry
from co2jax.engines import recovery

LR, H, BETA, ROUNDS = 0.1, tb.REGISTERED_H, 0.9, 4
BAD = (1, 1)  # (round, replica)
TOL = harness.TOL[jnp.dtype(jnp.float32)]


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, dim=16, seed=5)


def _unguarded(name: str, problem):
    """``(outer, inner)`` of the registry's ``name`` without ``skip_nonfinite`` (a guard
    restarted the inner state before this module existed; these tests are about the rest)."""
    algorithm = tb.VARIANTS[name][0] if name in tb.VARIANTS else name
    off = {"skip_nonfinite": False} if registry.capabilities(algorithm).guardable else {}
    return harness.registered(name, problem, LR, H, **off)


def _run(trainer, problem, poisoned=(), weights=None, rounds=ROUNDS):
    """``rounds`` rounds, replica r's batch of round t NaN for each (t, r) in ``poisoned``:
    ``([rounds, R, dim] parameters after each round, [rounds, R, H] losses, final state)``."""
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    params, losses = [], []
    for t in range(rounds):
        batch = textbook_batch(problem, H)
        for r in (r for s, r in poisoned if s == t):
            batch = {**batch, "d": batch["d"].at[r, 2].set(jnp.nan)}
        state, metrics = trainer.round(
            state, batch, weights=None if weights is None else weights[t]
        )
        params.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
        losses.append(np.asarray(metrics.loss))
    return np.stack(params), np.stack(losses), state


def _taken_part_again(losses, anchors):
    """Every anchor finite; the poisoned replica's losses finite from the next round on."""
    assert np.all(np.isfinite(anchors)), anchors
    assert np.all(np.isfinite(losses[BAD[0] + 1 :, BAD[1]])), losses[:, BAD[1]]
    assert not np.all(np.isfinite(losses[BAD[0], BAD[1]]))  # the poison did land


@pytest.mark.parametrize("delay", [0, 1], ids=["diloco", "delayed"])
@pytest.mark.parametrize("how", ["exclude_nonfinite", "zero_weight"])
def test_a_poisoned_replica_takes_part_again_in_the_next_round(problem, mesh, delay, how):
    """Inner heavy-ball SGD (a state that a NaN poisons): replica 1's batch of round 1 has a
    NaN. Left out by ``exclude_nonfinite=True``, or by a weight of 0 in the round that
    reduces its payload (round 1, or round 2 when delayed) with no guard: its inner state
    restarts at 0 from the anchor, its pseudo-gradients of rounds 2 and 3 are averaged, and
    the anchors equal the textbook loop's. (Before the restart its momentum stayed NaN: left
    out of every later round, or, weighed 1 again, every replica NaN.)"""
    name = "delayed_diloco" if delay else "diloco"
    outer, _ = _unguarded(name, problem)
    eta, mu = tb.REGISTERED[name][0]["learning_rate"], tb.REGISTERED[name][0]["momentum"]
    inner = optax.sgd(LR, momentum=BETA)
    exclude = how == "exclude_nonfinite"
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite=exclude)
    weights = None
    if not exclude:
        weights = [[1.0] * 4 for _ in range(ROUNDS)]
        weights[BAD[0] + delay][BAD[1]] = 0.0
    got, losses, _ = _run(trainer, problem, [BAD], weights)
    _taken_part_again(losses, got)
    want = tm.diloco_poisoned(problem, LR, BETA, H, ROUNDS, eta, mu, {BAD}, delay=delay)
    np.testing.assert_allclose(got, want, **TOL)
    excluded_for_good = {(t, BAD[1]) for t in range(BAD[0], ROUNDS)}
    other = tm.diloco_poisoned(problem, LR, BETA, H, ROUNDS, eta, mu, excluded_for_good, delay)
    assert np.abs(want[-1] - other[-1]).max() > 1e-3  # taking part again changes the anchor


@pytest.mark.parametrize(
    "layout", [{}, {"shard_outer_state": True}, {"fsdp": True}], ids=["whole", "sharded", "fsdp"]
)
def test_a_poisoned_replicas_error_feedback_restarts_at_zero(problem, mesh, layout):
    """SparseLoCo (top-k with error feedback): the poisoned replica's residual restarts at 0
    and its payloads of the later rounds are averaged again (the textbook loop's anchors),
    with the outer state whole, split over data, and parameters split too (FSDP)."""
    outer, inner = _unguarded("sparseloco", problem)
    trainer = co2jax.RoundTrainer(
        engine_loss, inner, outer, mesh, H, exclude_nonfinite=True, **layout
    )
    got, losses, state = _run(trainer, problem, [BAD])
    _taken_part_again(losses, got)
    want = tm.sparseloco(problem, LR, H, ROUNDS, 1.0, 0.95, 4, 8, [[1] * 4] * ROUNDS, {BAD})
    np.testing.assert_allclose(got, want, **TOL)
    memory = recovery.memory_of(jax.device_get(state.outer_state))
    assert memory and all(np.all(np.isfinite(x)) for x in memory)


def _restartable(name: str) -> bool:
    outer, _ = harness.registered(name, tb.make_problem(replicas=4, dim=16), LR, H)
    return bool(outer.schedule) and not outer.replica_local


RESTARTABLE = [n for n in (*registry.NAMES, *tb.VARIANTS) if _restartable(n)]
_QUICK = {"streaming_diloco", "co2", "diloco_x", "sparseloco[production]"}


@pytest.mark.parametrize(
    "name",
    [n if n in _QUICK else pytest.param(n, marks=pytest.mark.slow) for n in RESTARTABLE],
)
def test_every_algorithm_with_a_shared_anchor_recovers_a_poisoned_replica(name, problem, mesh):
    """Every registered algorithm with a replica-invariant anchor, inner Adam (moments a NaN
    poisons): after the poisoned round the replica holds the anchor (Streaming DiLoCo's
    own mixed fragments included), finite moments and finite own memory; its later rounds'
    losses and every anchor are finite; the healthy replicas' round 0 is untouched."""
    outer, _ = _unguarded(name, problem)
    inner = optax.adam(0.05)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite=True)
    got, losses, _ = _run(trainer, problem, [BAD])
    _taken_part_again(losses, got)
    clean, _, _ = _run(trainer, problem, rounds=1)
    np.testing.assert_array_equal(got[0], clean[0])
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    for t in range(BAD[0] + 1):
        batch = textbook_batch(problem, H)
        if t == BAD[0]:
            batch = {**batch, "d": batch["d"].at[BAD[1], 2].set(jnp.nan)}
        state, _ = trainer.round(state, batch)
    state = jax.device_get(state)
    one = lambda tree: jax.tree.map(lambda x: x[BAD[1]], tree)
    anchor = co2jax.protocol.anchor_of(one(state.outer_state))
    jax.tree.map(np.testing.assert_array_equal, one(state.params), anchor)
    assert not recovery.poisoned(one(state.params), one(state.inner_state), one(state.outer_state))


def test_a_healthy_replicas_state_is_untouched_bit_for_bit():
    """restart_poisoned changes nothing of a finite replica, and restarts a poisoned one:
    the anchor, a fresh inner state, fresh own memory, in-flight payloads kept."""
    ef = co2jax.error_feedback(
        co2jax.delayed_diloco(
            co2jax.outer_sgd(0.7),
            reduce=co2jax.comm.all_gather_compressed(co2jax.comm.int8(block=4)),
        )
    )
    inner = optax.adam(0.1)
    anchor = {"w": jnp.arange(8.0)}
    outer_state = ef.init(anchor)
    params = {"w": anchor["w"] + 0.5}
    inner_state = inner.update(params, inner.init(params), params)[1]
    quarter = lambda tree: jax.tree.map(lambda x: jnp.full_like(x, 0.25), tree)
    outer_state = outer_state._replace(residuals=quarter(outer_state.residuals))
    same = recovery.restart_poisoned(params, inner_state, outer_state, inner.init, ef.init)
    jax.tree.map(np.testing.assert_array_equal, same, (params, inner_state, outer_state))
    bad = {"w": params["w"].at[3].set(jnp.inf)}
    pending = outer_state.inner_state.pending
    outer_state = outer_state._replace(
        inner_state=outer_state.inner_state._replace(pending=({"w": jnp.full(8, jnp.nan)},))
    )
    p, s, o = recovery.restart_poisoned(bad, inner_state, outer_state, inner.init, ef.init)
    np.testing.assert_array_equal(p["w"], anchor["w"])
    jax.tree.map(np.testing.assert_array_equal, s, inner.init(anchor))
    jax.tree.map(lambda x: np.testing.assert_array_equal(x, np.zeros(8)), o.residuals)
    assert np.all(np.isnan(o.inner_state.pending[0]["w"]))  # due in the next reduction
    assert pending is not None


@pytest.mark.parametrize("name", ["eager_diloco", "ddp"])
def test_exclude_nonfinite_refuses_what_cannot_weigh_a_replica(problem, mesh, name):
    outer, inner = harness.registered(name, problem, LR, H)
    with pytest.raises(
        ValueError,
        match=r"^exclude_nonfinite=True: needs (a replica-invariant anchor|an outer reduction)",
    ):
        co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite=True)
    with pytest.raises(ValueError, match=r"exclude_nonfinite must be"):
        co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite="yes")
