"""Outer optimizers by name and their schedules by outer step (docs/optax.md): DiLoCo with
M = 1 and scheduled Nesterov (SNOO), outer Adam, against numpy loops."""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax.algorithms import outer_schedules as osched
from co2jax.algorithms import registry
from co2jax.algorithms.fused import fusable_of

LR, H, ROUNDS = 0.1, 4, 8
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def _warmup_cosine(peak, warmup, rounds, final):
    """Written out: linear from 0 over `warmup` steps, cosine to final * peak at `rounds`."""

    def f(s):
        if s < warmup:
            return peak * s / warmup
        k = min(s - warmup, rounds - warmup) / (rounds - warmup)
        return peak * ((1 - final) * 0.5 * (1 + math.cos(math.pi * k)) + final)

    return f


def test_the_learning_rate_schedules_are_the_formulas():
    got = osched.learning_rate_schedule(0.8, "cosine", warmup=3, rounds=10, final=0.1)
    want = _warmup_cosine(0.8, 3, 10, 0.1)
    np.testing.assert_allclose([float(got(s)) for s in range(12)], [want(s) for s in range(12)],
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    linear = osched.learning_rate_schedule(1.0, "linear", rounds=4, final=0.5)
    np.testing.assert_allclose([float(linear(s)) for s in range(6)],
                               [1.0, 0.875, 0.75, 0.625, 0.5, 0.5])  # fmt: skip
    assert osched.learning_rate_schedule(0.7) == 0.7  # a constant stays a constant
    ramp = osched.momentum_schedule(0.9, warmup=3)
    np.testing.assert_allclose([float(ramp(s)) for s in range(5)], [0, 0.3, 0.6, 0.9, 0.9])


def test_momentum_warm_up_and_decay_are_the_formula():
    """Linear from 0 over W steps, mu, then linear to mu_final over the last D steps before
    outer step `rounds` (the learning-rate decay's convention)."""
    mu = osched.momentum_schedule(0.9, warmup=3, decay=4, final=0.1, rounds=12)
    want = [0.9 * min(s, 3) / 3 if s < 8 else 0.9 + (0.1 - 0.9) * min(s - 8, 4) / 4
            for s in range(14)]  # fmt: skip
    np.testing.assert_allclose([float(mu(s)) for s in range(14)], want, rtol=1e-6, atol=1e-7)
    decay_only = osched.momentum_schedule(0.8, decay=2, rounds=4)
    np.testing.assert_allclose([float(decay_only(s)) for s in range(5)], [0.8, 0.8, 0.8, 0.4, 0])


def _warmup_decay(mu, warmup, decay, final, rounds):
    return lambda s: (
        mu * min(s, warmup) / warmup if s < rounds - decay and warmup
        else mu if s < rounds - decay
        else mu + (final - mu) * (s - (rounds - decay)) / decay
    )  # fmt: skip


@pytest.mark.parametrize("restart", [0, 3])
def test_momentum_schedules_and_restarts_are_the_loop(restart):
    """DiLoCo (R = 4) with a momentum warm-up, a decay over the last rounds, and restarts of
    the momentum buffer every 3 outer steps (or none), from the registry's config, equal to
    the numpy loop; the restarts change the trajectory."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=8)
    fields = dict(learning_rate=0.8, momentum=0.9, momentum_warmup=2, momentum_decay=3,
                  momentum_final=0.3, momentum_restart=restart)  # fmt: skip
    got, _ = harness.run_vmap(_build(problem, **fields), problem, LR, H, ROUNDS)
    mu = _warmup_decay(0.9, 2, 3, 0.3, ROUNDS)
    want = tb.diloco_scheduled(problem, LR, H, ROUNDS, lambda s: 0.8, mu, restart_every=restart)
    np.testing.assert_allclose(got, want, **TOL)
    if restart:
        other = tb.diloco_scheduled(problem, LR, H, ROUNDS, lambda s: 0.8, mu)
        assert np.abs(other[-1] - want[-1]).max() > 1e-3


def test_a_restart_every_step_is_sgd_at_one_plus_mu_times_the_rate():
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=9)
    restarted = _build(problem, learning_rate=0.5, momentum=0.6, momentum_restart=1)
    plain = _build(problem, learning_rate=0.5 * 1.6, momentum=0.0)
    got, _ = harness.run_vmap(restarted, problem, LR, H, ROUNDS)
    want, _ = harness.run_vmap(plain, problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, want, **TOL)
    assert fusable_of(osched.outer_transform("sgd", 0.5, 0.6, restart_every=1)) is None


def test_momentum_restarts_run_in_the_round_engine():
    """The round engine (4 x 2 mesh) with restarts every 2 outer steps: the loop's anchors."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=10)
    trainer, state, batch = _engine_round(problem, momentum=0.9, momentum_restart=2)
    got = []
    for _ in range(4):
        state, _ = trainer.round(state, batch)
        got.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    want = tb.diloco_scheduled(problem, LR, H, 4, lambda s: 0.7, lambda s: 0.9, restart_every=2)
    np.testing.assert_allclose(np.stack(got), want, **TOL)


def test_constants_stay_fusable_and_schedules_do_not():
    assert fusable_of(osched.outer_transform("sgd", 0.7, 0.9)) is not None
    lr = osched.learning_rate_schedule(0.7, warmup=2)
    assert fusable_of(osched.outer_transform("sgd", lr, 0.9)) is None
    assert fusable_of(osched.outer_transform("adam", 0.1, 0.9)) is None


def _build(problem, rounds=ROUNDS, **fields):
    settings = registry.settings("diloco", **fields)
    params = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    context = registry.Context(H, params, LR, num_replicas=problem.replicas, rounds=rounds)
    return settings.outer(context)


def test_diloco_with_one_replica_and_scheduled_nesterov_is_its_loop():
    """M = 1 (SNOO's setting) with a warm-up and cosine outer learning rate and a momentum
    ramp, built from the registry's config, under vmap over a replica axis of size 1."""
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=2)
    fields = dict(learning_rate=0.8, momentum=0.9, lr_schedule="cosine", lr_warmup=2,
                  lr_final=0.1, momentum_warmup=3)  # fmt: skip
    outer = _build(problem, **fields)
    got, _ = harness.run_vmap(outer, problem, LR, H, ROUNDS)
    eta = _warmup_cosine(0.8, 2, ROUNDS, 0.1)
    mu = lambda s: 0.9 * min(s, 3) / 3
    want = tb.diloco_scheduled(problem, LR, H, ROUNDS, eta, mu)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.abs(want[0] - problem.theta0).max() == 0  # outer step 0 has lr 0: no move
    assert np.abs(want[-1] - problem.theta0).max() > 1e-2


def test_snoo_runs_without_any_replica_axis():
    """A plain single-device optax loop (no vmap, no mesh): SNOO equals its loop."""
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=3)
    lr = osched.learning_rate_schedule(0.7, "linear", warmup=1, rounds=ROUNDS, final=0.2)
    tx = co2jax.local_updates(optax.sgd(LR), co2jax.snoo(lr, 0.9), sync_every=H)
    params = harness.unflatten(jnp.asarray(problem.theta0, jnp.float32))
    state = tx.init(params)
    d, c = jnp.asarray(problem.d[0]), jnp.asarray(problem.c[0])

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(harness.loss_fn)(params, d, c), state, params)
        return optax.apply_updates(params, updates), state

    got = []
    for k in range(ROUNDS * H):
        params, state = step(params, state)
        if (k + 1) % H == 0:
            got.append(np.asarray(harness.flatten(params), np.float64)[None])
    want = tb.diloco_scheduled(problem, LR, H, ROUNDS, lr, lambda s: 0.9)
    np.testing.assert_allclose(np.stack(got), want, **TOL)


def test_outer_adam_is_its_loop():
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=4)
    outer = _build(problem, optimizer="adam", learning_rate=0.05, momentum=0.8, beta2=0.95)
    got, _ = harness.run_vmap(outer, problem, LR, H, ROUNDS)
    want = tb.diloco_adam(problem, LR, H, ROUNDS, 0.05, 0.8, 0.95)
    np.testing.assert_allclose(got, want, **TOL)


def test_scheduled_streaming_diloco_runs_in_the_round_engine():
    """Every fragment's outer transform counts its own outer steps: with a 2-round warm-up
    the first round moves no fragment's global copy (lr 0) and the second does."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=5)
    params = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    settings = registry.settings("streaming_diloco", lr_warmup=2, tau=1)
    outer = settings.outer(registry.Context(H, params, LR, rounds=3))
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    from test_engine import engine_loss, textbook_batch

    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    anchors = []
    for _ in range(2):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        anchors.append(harness.flatten(jax.device_get(state.outer_state.anchor))[0])
    np.testing.assert_array_equal(anchors[0], problem.theta0.astype(np.float32))
    assert np.abs(anchors[1] - anchors[0]).max() > 1e-3


def _engine_round(problem, **fields):
    """A RoundTrainer of DiLoCo on the 4 x 2 mesh, its initial state and one round's batch."""
    params = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    settings = registry.settings("diloco", **fields)
    outer = settings.outer(registry.Context(H, params, LR, rounds=3))
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    from test_engine import engine_loss, textbook_batch

    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    return trainer, state, textbook_batch(problem, H)


def test_outer_hyperparameters_in_the_state_are_the_same_diloco():
    """``lr_in_state``: the same trajectory as the fused constants (the textbook loop's, as
    checked elsewhere), at two learning rates, with and without momentum."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=6)
    assert fusable_of(osched.outer_transform("sgd", 0.7, 0.9, in_state=True)) is None
    for fields in (dict(learning_rate=0.7), dict(learning_rate=0.3, momentum=0.0)):
        got, _ = harness.run_vmap(_build(problem, lr_in_state=True, **fields), problem, LR, H, 4)
        want, _ = harness.run_vmap(_build(problem, **fields), problem, LR, H, 4)
        np.testing.assert_allclose(got, want, **TOL)


def test_outer_hyperparameters_in_the_state_make_one_program_for_every_value():
    """The compiled round of two outer learning rates and momenta is one program (the same
    HLO) with ``lr_in_state``, and two without it; the rounds differ as their lrs do."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=7)
    texts, anchors = {}, {}
    for in_state in (True, False):
        for lr, momentum in ((0.7, 0.9), (0.2, 0.5)):
            fields = dict(learning_rate=lr, momentum=momentum, lr_in_state=in_state)
            trainer, state, batch = _engine_round(problem, **fields)
            texts[in_state, lr] = trainer.lower(state, trainer.place_batch(batch)).as_text()
            state, _ = trainer.round(state, batch)
            anchors[in_state, lr] = harness.flatten(jax.device_get(state.params))
    assert texts[True, 0.7] == texts[True, 0.2]
    assert texts[False, 0.7] != texts[False, 0.2]  # the constants are in the program
    for lr in (0.7, 0.2):
        np.testing.assert_allclose(anchors[True, lr], anchors[False, lr], **TOL)
    assert np.abs(anchors[True, 0.7] - anchors[True, 0.2]).max() > 1e-3


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(lr_in_state=True, implementation="pallas"), "outer.lr_in_state=True: outer"),
        (dict(algorithm="co2", lr_in_state=True), "outer.lr_in_state=True: co2 has no such"),
        (dict(optimizer="lamb"), "outer.optimizer='lamb'"),
        (dict(lr_schedule="step"), "outer.lr_schedule='step'"),
        (dict(lr_warmup=-1), "outer.lr_warmup=-1"),
        (dict(lr_final=1.5), "outer.lr_final=1.5"),
        (dict(beta2=1.0), "outer.beta2=1.0"),
        (dict(algorithm="co2", lr_warmup=3), "outer.lr_warmup=3: co2 has no such setting"),
        (dict(algorithm="noloco", optimizer="adam"), "outer.optimizer='adam': noloco has no"),
        (dict(rounds=4, lr_schedule="cosine", lr_warmup=4), "outer.lr_warmup=4: must be < train"),
        (dict(momentum_decay=-1), "outer.momentum_decay=-1: must be >= 0"),
        (dict(momentum_restart=-2), "outer.momentum_restart=-2: must be >= 0"),
        (dict(momentum_decay=2, momentum_final=1.0), "outer.momentum_final=1.0: must be in"),
        (dict(momentum_final=0.5), "outer.momentum_final=0.5: ignored unless outer.momentum_d"),
        (dict(momentum_restart=3, optimizer="adam"), "outer.momentum_restart=3: restarts SGD"),
        (dict(momentum_restart=3, momentum=0.0), "outer.momentum_restart=3: restarts SGD"),
        (dict(rounds=5, momentum_warmup=3, momentum_decay=3), "outer.momentum_decay=3: with mo"),
        (dict(algorithm="co2", momentum_restart=2), "outer.momentum_restart=2: co2 has no such"),
    ],
)
def test_bad_outer_fields(fields, match):
    fields = {"algorithm": "diloco", **fields}
    rounds = fields.pop("rounds", None)
    with pytest.raises(ValueError, match=match):
        registry.settings(**fields).validate(registry.Bounds(sync_every=H, rounds=rounds))


def test_a_decay_needs_the_number_of_rounds():
    problem = tb.make_problem(replicas=1)
    with pytest.raises(ValueError, match=r"lr_schedule='cosine' decays .* give rounds"):
        _build(problem, rounds=None, lr_schedule="cosine")
    with pytest.raises(ValueError, match="lr_warmup=8 must be < rounds=8"):
        _build(problem, lr_schedule="cosine", lr_warmup=8)
