"""The outer state kept in host memory (``RoundTrainer(offload_outer_state=True)``): the
same trajectory, bit for bit, as on the device, for every kind of outer step (plain, delayed
with its payload in chunks, streamed fragments, compressed with error feedback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import co2jax
from co2jax.fragments import make_fragments

R, D, H, ROUNDS = 4, 2, 4, 3
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (6, 33)) * 0.3,  # 33: chunks and blocks that do not divide
        "w2": jax.random.normal(k2, (33, 2)) * 0.3,
    }


OUTERS = {
    "diloco": lambda: co2jax.diloco(NESTEROV),
    "co2": lambda: co2jax.co2(0.7, 0.5, clip_threshold=1.0),
    "streaming_diloco": lambda: co2jax.streaming_diloco(
        NESTEROV, make_fragments(_params(), 2), H, tau=1
    ),
    "sparseloco": lambda: co2jax.sparseloco(1.0, 0.9, k=4, chunk=16),
}
SPREAD = {"co2": True}  # its payload in a chunk per inner step, carried through the loop


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def _run(name, offload):
    mesh = co2jax.make_mesh(replica=R, data=D, devices=jax.devices()[: R * D])
    trainer = co2jax.RoundTrainer(
        _loss,
        optax.adamw(1e-2),
        OUTERS[name](),
        mesh,
        H,
        offload_outer_state=offload,
        spread=SPREAD.get(name, False),
    )
    state = trainer.init(_params())
    rng = np.random.default_rng(1)
    for _ in range(ROUNDS):
        x = rng.normal(size=(R, H, 8, 6)).astype(np.float32)
        state, _ = trainer.round(state, {"x": x, "y": np.sin(x[..., :2])})
    return state


@pytest.mark.parametrize("name", list(OUTERS))
def test_the_outer_state_in_host_memory_changes_no_value(name):
    device, host = _run(name, False), _run(name, True)
    for leaf in jax.tree.leaves(host.outer_state):
        assert leaf.sharding.memory_kind == "pinned_host"
    for leaf in jax.tree.leaves(host.params):
        assert leaf.sharding.memory_kind == "device"
    assert jax.tree.structure(device) == jax.tree.structure(host)
    for a, b in zip(jax.tree.leaves(device), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
