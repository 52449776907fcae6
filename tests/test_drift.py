"""Drift detection: fingerprints of the replica-invariant outer state (co2jax.engines.drift)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax


def test_fingerprint_sees_every_bit_and_nothing_else():
    x = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1, 2], jnp.int32)}
    same = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1, 2], jnp.int32)}
    assert int(co2jax.fingerprint(x)) == int(co2jax.fingerprint(same))
    digests = {int(co2jax.fingerprint(x))}
    flat = np.asarray(x["a"]).view(np.uint32).reshape(-1)
    for i in range(flat.size):  # one bit flipped anywhere changes it
        for bit in (0, 17, 31):
            flipped = flat.copy()
            flipped[i] ^= np.uint32(1 << bit)
            y = {**x, "a": jnp.asarray(flipped.view(np.float32).reshape(2, 3))}
            digests.add(int(co2jax.fingerprint(y)))
    assert len(digests) == 1 + 3 * flat.size
    swapped = {"a": x["a"][::-1], "b": x["b"]}  # the same values elsewhere
    assert int(co2jax.fingerprint(swapped)) != int(co2jax.fingerprint(x))
    bf16 = jnp.ones(4, jnp.bfloat16)
    assert int(co2jax.fingerprint(bf16)) != int(co2jax.fingerprint(bf16.at[2].set(1.0078125)))


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


@pytest.mark.parametrize("name", ["diloco", "sparseloco", "streaming_diloco"])
@pytest.mark.cases("first", 2)
def test_the_round_engine_keeps_anchors_identical_and_an_injected_drift_fires(name, mesh):
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=5)
    outer, inner = harness.registered(name, problem, 0.1, tb.REGISTERED_H)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, tb.REGISTERED_H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    for t in range(3):
        state, _ = trainer.round(state, textbook_batch(problem, tb.REGISTERED_H))
        co2jax.check_drift(co2jax.replica_fingerprints(state.outer_state), round=t)
    # replica 2's copy of the anchor moved by one unit in the last place: a silent drift
    host = jax.device_get(state.outer_state)
    leaves, _ = jax.tree_util.tree_flatten_with_path(host)
    path = next(p for p, _ in leaves if "anchor" in jax.tree_util.keystr(p))

    def bump(p, x):
        if p != path:
            return x
        x = np.array(x)
        x[2].flat[0] = np.nextafter(x[2].flat[0], np.inf)
        return x

    drifted = jax.tree.unflatten(jax.tree.structure(host), [bump(p, x) for p, x in leaves])
    with pytest.raises(co2jax.DriftError, match=r"round 3: .*replicas \[2\] drifted") as e:
        co2jax.check_drift(co2jax.replica_fingerprints(drifted), round=3)
    assert e.value.replicas == (2,) and e.value.round == 3


def test_replica_local_anchors_have_nothing_to_compare():
    with pytest.raises(ValueError, match=r"\(dict\) declares no anchor to compare"):
        co2jax.replica_fingerprints({"error": jnp.zeros((2, 3))})
