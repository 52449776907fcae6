"""Figures recorded by other implementations' tests, reproduced with co2jax's public API.

The data files are copies of ``shared/conformance/`` (checked equal when that folder exists).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import co2jax

HERE = Path(__file__).parent / "conformance"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "conformance"


@pytest.mark.parametrize("name", ["maxtext_diloco.json", "torchft_streaming_diloco.json"])
def test_vendored_copy_matches_shared(name):
    if not (SHARED / name).exists():
        pytest.skip("shared/conformance is not beside this checkout")
    assert json.loads((HERE / name).read_text()) == json.loads((SHARED / name).read_text())


def test_maxtext_diloco_case():
    """Two replicas of a 2->1 linear model, inner SGD 0.1, sync after 3 steps, Nesterov outer."""
    case = json.loads((HERE / "maxtext_diloco.json").read_text())
    setting, expected = case["setting"], case["expected"]
    data = setting["data"]
    x = jnp.asarray([data["replica_0"]["x"], data["replica_1"]["x"]], jnp.float32)
    y = jnp.asarray([data["replica_0"]["labels"], data["replica_1"]["labels"]], jnp.float32)
    params = {"w": jnp.asarray([[2.0, 1.0]] * 2), "b": jnp.asarray([1.0, 1.0])}

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    outer = co2jax.diloco(optax.sgd(learning_rate=1.0, momentum=0.9, nesterov=True))
    tx = co2jax.local_updates(optax.sgd(0.1), outer, sync_every=setting["sync_every"])
    state = jax.vmap(tx.init)(params)

    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        local = jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)  # the inner step alone
        return optax.apply_updates(p, updates), s, loss, local

    step = jax.jit(jax.vmap(step, axis_name="replica"))
    losses = []
    for _ in range(3):
        params, state, loss, local = step(params, state, x, y)
        losses.append(np.asarray(loss))
    losses.append(np.asarray(jax.vmap(loss_fn)(params, x, y)))
    losses = np.stack(losses)

    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[:4, 0], expected["replica_0_loss_by_step"], **tol)
    np.testing.assert_allclose(losses[:3, 1], expected["replica_1_loss_by_step"], **tol)
    # the replicas' local parameters after 3 inner steps (before the sync moved them)
    for r in (0, 1):
        want = expected["local_after_3_steps"][f"replica_{r}"]
        np.testing.assert_allclose(local["w"][r], want["w"], **tol)
        np.testing.assert_allclose(local["b"][r], want["b"], **tol)
    anchor = expected["anchor_after_first_sync"]  # recorded to 4 decimals
    for r in (0, 1):
        np.testing.assert_allclose(params["w"][r], anchor["w"], rtol=1e-4)
        np.testing.assert_allclose(params["b"][r], anchor["b"], rtol=1e-4)
