"""skip_nonfinite: a non-finite averaged pseudo-gradient skips the outer step everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import co2jax


def _sync(outer):
    return jax.jit(jax.vmap(outer.sync, axis_name="replica"))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_local_sgd_skip_keeps_anchor_and_counts(bad):
    outer = co2jax.skip_nonfinite(co2jax.local_sgd())
    state = jax.vmap(outer.init)(jnp.zeros((2, 3)))
    sync = _sync(outer)
    params, state = sync(jnp.array([[1.0, 1, 1], [bad, 3, 3]]), state)
    np.testing.assert_array_equal(params, jnp.zeros((2, 3)))
    np.testing.assert_array_equal(state.num_skipped, [1, 1])
    params, state = sync(params + jnp.array([[1.0], [3.0]]), state)  # a healthy round
    np.testing.assert_allclose(params, jnp.full((2, 3), 2.0))
    np.testing.assert_array_equal(state.num_skipped, [1, 1])


def test_diloco_skip_keeps_outer_state():
    outer = co2jax.skip_nonfinite(co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)))
    state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
    sync = _sync(outer)
    params, state = sync(jnp.array([[1.0], [3.0]]), state)
    before = state
    params, state = sync(jnp.array([[jnp.nan], [3.0]]), state)
    np.testing.assert_array_equal(params, before.inner_state.anchor)
    kept = (state.inner_state.anchor, state.inner_state.outer_state)
    old = (before.inner_state.anchor, before.inner_state.outer_state)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(state.inner_state.count, before.inner_state.count + 1)


def test_unwrapped_diloco_would_be_poisoned():
    """The guard matters: without it the NaN reaches every replica's anchor."""
    outer = co2jax.diloco(optax.sgd(0.7))
    state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
    params, _ = _sync(outer)(jnp.array([[jnp.nan], [3.0]]), state)
    assert np.isnan(np.asarray(params)).all()


def test_co2_skips_the_round_its_stale_average_arrives_then_recovers():
    wrapped = co2jax.skip_nonfinite(co2jax.co2(1.0, 0.5))
    plain = co2jax.co2(1.0, 0.5)
    ws, ps = (jax.vmap(o.init)(jnp.zeros((2, 1))) for o in (wrapped, plain))
    wsync, psync = _sync(wrapped), _sync(plain)
    offsets = jnp.array([[1.0], [3.0]])
    wp, ws = wsync(offsets, ws)
    pp, ps = psync(offsets, ps)
    np.testing.assert_array_equal(wp, pp)  # finite rounds: identical to the plain algorithm
    # round 1: replica 0 diverges; its pseudo-gradient is only averaged at the next sync
    wp, ws = wsync(jnp.array([[jnp.nan], [3.0]]), ws)
    assert np.isfinite(np.asarray(wp)).all()
    np.testing.assert_array_equal(ws.num_skipped, [0, 0])
    anchor = ws.inner_state.anchor
    momentum = ws.inner_state.outer_state.momentum
    # round 2: the NaN average arrives -> skipped on every replica, state kept
    wp, ws = wsync(wp + offsets, ws)
    np.testing.assert_array_equal(ws.num_skipped, [1, 1])
    np.testing.assert_array_equal(wp, anchor)
    np.testing.assert_array_equal(ws.inner_state.outer_state.momentum, momentum)
    # round 3: healthy again (the pending pseudo-gradient came from the restarted replicas)
    wp, ws = wsync(wp + offsets, ws)
    np.testing.assert_array_equal(ws.num_skipped, [1, 1])
    assert np.isfinite(np.asarray(wp)).all()
    assert not np.array_equal(np.asarray(wp), np.asarray(anchor))


def test_refuses_replica_local_anchors():
    """Eager updates keep replica-local anchors: a partial skip could never be undone."""
    with pytest.raises(ValueError, match="replica_local=True"):
        co2jax.skip_nonfinite(co2jax.eager_diloco(optax.sgd(0.7)))


def test_requires_an_anchor():
    bare = co2jax.OuterOptimizer(
        init=lambda p: (),
        send=lambda p, s, i: (p, s),
        reducer=co2jax.comm.pmean(),
        apply=lambda p, s, i, r: (p, s),
    )
    with pytest.raises(TypeError, match="anchor"):
        co2jax.skip_nonfinite(bare).init(jnp.zeros(2))


def test_a_nan_in_one_data_shard_skips_the_step_on_every_shard():
    """Round engine with shard_outer_state: each device checks its shard of the average; the
    skip must still be one decision (before the fix the program did not even compile)."""
    import textbook as tb
    from test_engine import engine_loss, textbook_batch

    problem = tb.make_problem(replicas=4, examples=2)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    outer = co2jax.skip_nonfinite(co2jax.local_sgd())
    trainer = co2jax.RoundTrainer(
        engine_loss, optax.sgd(0.1), outer, mesh, sync_every=3, shard_outer_state=True
    )
    theta0 = jnp.asarray(problem.theta0, jnp.float32)
    state = trainer.init({"b": theta0[:2], "w": theta0[2:]})
    batch = textbook_batch(problem)
    poisoned = dict(batch, c=batch["c"].at[1, :, :, 0].set(jnp.nan))  # "b"[0]: data shard 0
    state, _ = trainer.round(state, poisoned)
    np.testing.assert_array_equal(state.outer_state.num_skipped, [1, 1, 1, 1])
    np.testing.assert_array_equal(state.params["b"], jnp.broadcast_to(theta0[:2], (4, 2)))
    state, _ = trainer.round(state, batch)  # and it recovers
    np.testing.assert_array_equal(state.outer_state.num_skipped, [1, 1, 1, 1])
    assert np.isfinite(np.asarray(state.params["b"])).all()


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "shard_outer_state"])
def test_a_poisoned_adamw_replica_recovers_in_the_round_engine(shard):
    """A NaN batch on one replica turns its AdamW moments NaN. The round is skipped, and
    the replica's inner state is reset at the round's end: the next rounds apply (before,
    every later round was skipped too)."""
    import textbook as tb
    from test_engine import engine_loss, textbook_batch

    problem = tb.make_problem(replicas=4, examples=2)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    outer = co2jax.skip_nonfinite(co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)))
    trainer = co2jax.RoundTrainer(
        engine_loss, optax.adamw(0.05), outer, mesh, sync_every=3, shard_outer_state=shard
    )
    theta0 = jnp.asarray(problem.theta0, jnp.float32)
    state = trainer.init({"b": theta0[:2], "w": theta0[2:]})
    batch = textbook_batch(problem)
    poisoned = dict(batch, c=batch["c"].at[2].set(jnp.nan))  # replica 2's whole batch
    state, _ = trainer.round(state, batch)
    state, _ = trainer.round(state, poisoned)
    np.testing.assert_array_equal(state.outer_state.num_skipped, [1] * 4)
    for _ in range(3):
        state, metrics = trainer.round(state, batch)
    np.testing.assert_array_equal(state.outer_state.num_skipped, [1] * 4)
    assert np.isfinite(np.asarray(metrics.loss)).all()
    for leaf in jax.tree.leaves(state):
        assert np.isfinite(np.asarray(leaf)).all()


def test_a_poisoned_replica_skips_its_step_in_local_updates():
    """local_updates: a NaN gradient on one replica skips that replica's inner step (its
    updates are zero, its inner state kept, its step counted), so the replicas stay in step
    and the sync applies; before, the replica stayed NaN and the others were reset to a
    frozen anchor at every sync."""
    H, R = 3, 4
    outer = co2jax.skip_nonfinite(co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)))
    tx = co2jax.local_updates(optax.adamw(0.05), outer, H)
    rng = np.random.default_rng(0)
    params = jnp.broadcast_to(jnp.asarray(rng.normal(size=5), jnp.float32), (R, 5))
    start = float(jnp.abs(params[0] - 1.0).max())
    state = jax.vmap(tx.init)(params)
    step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="replica"))
    for t in range(4 * H):
        grads = params - 1.0
        if t == H + 1:
            grads = grads.at[2].set(jnp.nan)
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(state.outer_state.num_skipped, [0] * R)
    assert np.isfinite(np.asarray(params)).all()
    np.testing.assert_array_equal(params, jnp.broadcast_to(params[0], params.shape))  # synced
    assert float(jnp.abs(params[0] - 1.0).max()) < start  # and it trained towards 1
