"""The gather-free top-k, the per-row scatter and the look-up against their textbook twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import co2jax
from co2jax.comm.select import (
    lookup,
    scatter_rows,
    scatter_rows_reference,
    top_k_by_magnitude,
    top_k_by_magnitude_reference,
)


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


@pytest.mark.parametrize("add", [False, True], ids=["set", "add"])
def test_scatter_rows_equals_one_scatter_with_row_indices(add):
    """Per row, distinct indices (set) or repeated ones (add: summed), 7 rows of width 13."""
    rng = np.random.default_rng(3)
    if add:
        idx = rng.integers(0, 13, size=(7, 9))
        idx[0, :3] = 4  # three into one place
    else:
        idx = np.stack([rng.permutation(13)[:5] for _ in range(7)])
    idx = jnp.asarray(idx, jnp.int32)
    vals = jnp.asarray(rng.normal(size=idx.shape), jnp.float32)
    got = jax.jit(scatter_rows, static_argnums=(2, 3))(idx, vals, 13, add)
    np.testing.assert_allclose(got, scatter_rows_reference(idx, vals, 13, add), rtol=1e-6)
    want = np.zeros((7, 13), np.float32)
    for r in range(7):
        for j in range(idx.shape[1]):
            if add:
                want[r, idx[r, j]] += vals[r, j]
            else:
                want[r, idx[r, j]] = vals[r, j]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scatter_rows_splits_by_rows_where_its_twin_gathers():
    """Rows split over ``data`` (12 rows over 2 devices): the per-row scatter
    compiles with no collective, the one with a row index per element gathers the rows
    (the all-gathers that held a TPU round's top-k exchange out of flight)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = co2jax.make_mesh(replica=4, data=2)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    idx, vals = jnp.zeros((12, 3), jnp.int32), jnp.zeros((12, 3), jnp.float32)

    def compiled(fn):
        run = jax.jit(lambda i, v: fn(i, v, 16), in_shardings=(rows, rows), out_shardings=rows)
        return run.lower(idx, vals).compile().as_text()

    assert "all-gather" not in compiled(scatter_rows)
    assert "all-gather" in compiled(scatter_rows_reference)
