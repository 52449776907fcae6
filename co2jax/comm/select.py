"""Top-k by magnitude, its scatter back and table look-ups, written so that XLA's SPMD
partitioner splits them by rows (a sort and a select, no gather; a scatter per row).

Every compressed reducer picks, per row of a chunked payload, the ``k`` largest-magnitude
entries and their values. The textbook form is ``lax.top_k`` then ``take_along_axis`` (a
gather); here it is one stable sort of (``-|x|``, ``x``, position) along the row, the first
``k`` kept: the same indices in the same order (equal magnitudes: the lower position first,
as ``lax.top_k``; a NaN ranks first, as in ``lax.top_k``) and the same values
(:func:`top_k_by_magnitude_reference` is the twin a test compares). Why: inside the engines'
replica-manual programs a row split over both ``data`` and ``model`` reaches a gather that
XLA's SPMD partitioner aborts the process on (jax 0.10.2: ``spmd_partitioner_util.cc``
``Check failed: partition_group_list.num_replica_groups() * ...``); a sort and a select
partition as any element-wise op does. The way back, :func:`scatter_rows`, is a scatter
batched over the rows: written with a row index per element instead, the partitioner
gathers a chunk split over ``data`` whole onto every chip before scattering it (two
all-gathers a step in a TPU round that spreads top-k with error feedback; compiled, they
held the round's replica-axis gather out of flight).

Example:
  >>> import jax.numpy as jnp
  >>> idx, vals = top_k_by_magnitude(jnp.array([[1.0, -3.0, 2.0, 0.5]]), 2)
  >>> idx.tolist(), vals.tolist()
  ([[1, 2]], [[-3.0, 2.0]])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_by_magnitude(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest-magnitude entries of each row of ``x`` (``[rows, n]``): their
    positions (int32) and values, ``[rows, k]`` each, largest first."""
    key = jnp.where(jnp.isnan(x), -jnp.inf, -jnp.abs(x))
    position = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, values, idx = jax.lax.sort((key, x, position), dimension=x.ndim - 1, num_keys=1)
    return idx[..., :k], values[..., :k]


def top_k_by_magnitude_reference(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The textbook twin of :func:`top_k_by_magnitude`: ``lax.top_k`` of ``|x|`` and a
    gather of the values."""
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    return idx, jnp.take_along_axis(x, idx, axis=-1)


def scatter_rows(idx: jax.Array, values: jax.Array, width: int, add: bool = False) -> jax.Array:
    """``out[r, idx[r, j]] = values[r, j]`` (``add``: summed over repeated indices) in a
    ``[rows, width]`` array of zeros, as a scatter batched over the rows (each row's its
    own), so that a partitioner splits it by rows. :func:`scatter_rows_reference` is the
    twin a test compares.

    Example:
      >>> import jax.numpy as jnp
      >>> scatter_rows(jnp.array([[2, 0]]), jnp.array([[5.0, 7.0]]), 4).tolist()
      [[7.0, 0.0, 5.0, 0.0]]
    """

    def one(i: jax.Array, v: jax.Array) -> jax.Array:
        row = jnp.zeros((width,), values.dtype).at[i]
        return row.add(v) if add else row.set(v)

    return jax.vmap(one)(idx, values)


def scatter_rows_reference(
    idx: jax.Array, values: jax.Array, width: int, add: bool = False
) -> jax.Array:
    """The textbook twin of :func:`scatter_rows`: one scatter with a row index per element."""
    rows = jnp.arange(idx.shape[0])[:, None]
    at = jnp.zeros((idx.shape[0], width), values.dtype).at[rows, idx]
    return at.add(values) if add else at.set(values)


def lookup(table: jax.Array, codes: jax.Array) -> jax.Array:
    """``table[r, codes[r, j]]`` for every ``j``: ``table`` ``[rows, bins]`` (a few bins),
    ``codes`` ``[rows, n]`` integers in ``[0, bins)``; a select per bin, no gather."""
    out = jnp.zeros(codes.shape, table.dtype)
    for b in range(table.shape[-1]):
        out = jnp.where(codes == b, table[..., b : b + 1], out)
    return out
