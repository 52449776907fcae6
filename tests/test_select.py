"""The gather-free top-k and look-up against their textbook twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from co2jax.comm.select import lookup, top_k_by_magnitude, top_k_by_magnitude_reference


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_equals_lax_top_k_and_a_gather(k):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    x[1] = [1.0, -1.0, 1.0, 2.0, -2.0, 0.0, 0.0, 1.0]  # ties in magnitude, both signs
    x[2, 3] = np.inf
    x[3, 5] = -np.inf
    got = top_k_by_magnitude(jnp.asarray(x), k)
    want = top_k_by_magnitude_reference(jnp.asarray(x), k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_a_nan_ranks_first():
    x = jnp.array([[1.0, jnp.nan, -5.0, 2.0]])
    idx, vals = top_k_by_magnitude(x, 2)
    assert idx.tolist() == [[1, 2]] and bool(jnp.isnan(vals[0, 0])) and float(vals[0, 1]) == -5
    assert top_k_by_magnitude_reference(x, 2)[0].tolist() == [[1, 2]]


def test_lookup_equals_take_along_axis():
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    codes = jnp.asarray(rng.integers(0, 4, size=(5, 9)), jnp.int32)
    np.testing.assert_array_equal(lookup(table, codes), jnp.take_along_axis(table, codes, axis=1))


def test_under_vmap_and_jit():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 16)), jnp.float32)
    got = jax.jit(jax.vmap(lambda v: top_k_by_magnitude(v, 5)))(x)
    want = jax.vmap(lambda v: top_k_by_magnitude_reference(v, 5))(x)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
