"""Top-k by magnitude and table look-ups, written as a sort and a select (no gather).

Every compressed reducer picks, per row of a chunked payload, the ``k`` largest-magnitude
entries and their values. The textbook form is ``lax.top_k`` then ``take_along_axis`` (a
gather); here it is one stable sort of (``-|x|``, ``x``, position) along the row, the first
``k`` kept: the same indices in the same order (equal magnitudes: the lower position first,
as ``lax.top_k``; a NaN ranks first, as in ``lax.top_k``) and the same values
(:func:`top_k_by_magnitude_reference` is the twin a test compares). Why: inside the engines'
replica-manual programs a row split over both ``data`` and ``model`` reaches a gather that
XLA's SPMD partitioner aborts the process on (jax 0.10.2: ``spmd_partitioner_util.cc``
``Check failed: partition_group_list.num_replica_groups() * ...``); a sort and a select
partition as any element-wise op does.

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


def lookup(table: jax.Array, codes: jax.Array) -> jax.Array:
    """``table[r, codes[r, j]]`` for every ``j``: ``table`` ``[rows, bins]`` (a few bins),
    ``codes`` ``[rows, n]`` integers in ``[0, bins)``; a select per bin, no gather."""
    out = jnp.zeros(codes.shape, table.dtype)
    for b in range(table.shape[-1]):
        out = jnp.where(codes == b, table[..., b : b + 1], out)
    return out
