"""An exact mean in two stages, a reduce-scatter by direct sends and an all-gather, that a
round may run in consecutive inner steps: a ring all-reduce's bytes, each stage in flight.

Stage one (``scatter``): each replica cuts its vector into R pieces of whole rows and sends
piece j to replica j, as R - 1 independent ``ppermute``s (shift s: to replica i + s);
replica i averages the R copies of its piece in float32, in the replicas' order, and keeps
that mean in the payload's dtype (its *shard*). Stage two (``gather``): an all-gather of
the shards. Each replica sends ``(R-1)/R`` of the vector in each stage, ``2 (R-1)/R`` in
all: a ring all-reduce's bytes, where an all-gather of the whole vector sends ``R - 1``
times it.

.. math::

    \\bar x = \\operatorname{gather}_j \\Big(\\frac1R \\sum_{r=0}^{R-1} x_{r, j}\\Big)

Why permutes and not ``lax.psum_scatter`` or ``lax.all_to_all``: compiled for TPU ahead of
time, a reduce-scatter was an all-reduce and an all-to-all a synchronous collective, while
each permute and the all-gather were asynchronous under the step's compute (at R = 4 and
8: ``docs/overlap.md``). A round that spreads a transfer over its inner steps
(:mod:`co2jax.comm.chunks`) scatters piece k at step k and gathers it at step k + 1, so
neither stage waits on the other inside a step: K pieces over K + 1 steps, every step alike
(one loop body; its first gathers a zero share and its last scatters a piece again), so
``(K + 1) / K`` of the ring's bytes (1.03x at 32 steps). On TPU the round lets XLA keep a
step's R - 1 permutes in flight together (:func:`co2jax.comm.policy.compiler_options`).
Called as one reduction (``reduce``), the two stages run back to back: the same values.

Example:
  >>> import jax, jax.numpy as jnp
  >>> x = jnp.arange(12.0).reshape(4, 3)  # 4 replicas, 3 elements each
  >>> jax.jit(jax.vmap(staged_mean("replica"), axis_name="replica"))(x)[0]
  Array([4.5, 5.5, 6.5], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_choice
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.packing import pack_rows, unpack_rows
from co2jax.comm.reducer import Encoded, Grouped, Payload, Reducer, pmean, ring_bytes
from co2jax.tree import common_dtype, flatten, tree_size


class Stages(NamedTuple):
    """A reduction in two stages that a driver may run at consecutive steps.

    Attributes:
      scatter: ``scatter(vectors) -> shards``: per group, its ``[u, ...]`` array (a chunk's
        rows, or a whole vector) to this replica's reduced ``[ceil(u / R), ...]`` share.
      gather: ``gather(shards, rows) -> vectors``: the shards back to every replica's
        ``[u, ...]`` reduced arrays (``rows``: each group's ``u``).
      empty: ``empty(u, r, piece) -> share``: a zero share of a ``u``-row array shaped and
        typed like ``piece`` (a ``ShapeDtypeStruct``) over ``r`` replicas, shaped and typed
        as ``scatter`` returns it (what a round gathers at its first step, before any piece
        is scattered).
      permutes: collective-permutes a step issues per replica, in units of ``R - 1``: 1
        where only the scatter sends by permutes, 2 where the gather does too (what
        :func:`co2jax.comm.policy.compiler_options` lets XLA:TPU keep in flight).
    """

    scatter: Callable[[list[jax.Array]], list[Any]]
    gather: Callable[[list[Any], list[int]], list[jax.Array]]
    empty: Callable[[int, int, Any], Any]
    permutes: int = 1


def exchange(pieces: jax.Array, axis_name: str = REPLICA) -> jax.Array:
    """``pieces`` (``[R, ...]``, row j for replica j) exchanged: row j of the result is the
    piece replica j sent this replica, as ``lax.all_to_all(pieces, axis_name, 0, 0)``,
    by R - 1 independent ``ppermute``s (shift s sends row i + s to replica i + s).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(9.0).reshape(3, 3)  # replica r's row j: 3 r + j
      >>> swap = jax.vmap(lambda p: exchange(p, "r"), axis_name="r")
      >>> jax.jit(swap)(x)[1]  # replica 1 gets column 1
      Array([1., 4., 7.], dtype=float32)
    """
    r = pieces.shape[0]
    i = jax.lax.axis_index(axis_name)
    row = lambda a, j: jax.lax.dynamic_index_in_dim(a, j % r, keepdims=False)
    out = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(pieces), row(pieces, i), i, 0)
    for s in range(1, r):
        perm = [(j, (j + s) % r) for j in range(r)]
        got = jax.lax.ppermute(row(pieces, i + s), axis_name, perm)  # from replica i - s
        out = jax.lax.dynamic_update_index_in_dim(out, got, (i - s) % r, 0)
    return out


def exchange_tree(tree: Any, axis_name: str = REPLICA) -> Any:
    """Every leaf of ``tree`` (each ``[R, ...]``, row j for replica j) exchanged as by
    :func:`exchange`; several leaves (an encoding's values and scales) packed into one
    buffer of 32-bit words per row (:func:`co2jax.comm.packing.pack_rows`), so each shift
    is one ``ppermute``, as one all-gather carries an encoding (``all_gather_tree``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jnp.arange(8, dtype=jnp.int8).reshape(2, 2, 2)  # replica r's row j: [4r+2j, +1]
      >>> scale = jnp.array([[0.5, 1.0], [2.0, 4.0]])
      >>> got = jax.vmap(lambda t: exchange_tree(t, "r"), axis_name="r")((q, scale))
      >>> got[0][1], got[1][1]  # replica 1 gets row 1 of each replica's
      (Array([[2, 3], [6, 7]], dtype=int8), Array([1., 4.], dtype=float32))
    """
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) == 1:
        return jax.tree.unflatten(treedef, [exchange(leaves[0], axis_name)])
    words = exchange(pack_rows(leaves), axis_name)
    likes = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, unpack_rows(words, likes))


def shard_rows(u: int, r: int) -> int:
    """Rows of one replica's share of ``u`` rows over ``r`` replicas (the rows padded to a
    multiple of ``r``)."""
    return -(-u // r)


def scatter_mean(x: jax.Array, axis_name: str = REPLICA) -> jax.Array:
    """Stage one: this replica's share of the replicas' mean of ``x`` (``[u, ...]``), rows
    ``[i m, (i + 1) m)`` of the zero-padded ``[R m, ...]``, in ``x``'s dtype."""
    r, u = axis_size(axis_name), x.shape[0]
    m = shard_rows(u, r)
    pieces = jnp.pad(x, [(0, r * m - u)] + [(0, 0)] * (x.ndim - 1)).reshape(r, m, *x.shape[1:])
    mine = exchange(pieces, axis_name).astype(jnp.float32)
    return jnp.mean(mine, axis=0).astype(x.dtype)


def gather_shards(shard: jax.Array, u: int, axis_name: str = REPLICA) -> jax.Array:
    """Stage two: every replica's share all-gathered, the first ``u`` rows."""
    gathered = jax.lax.all_gather(shard, axis_name)
    return gathered.reshape(-1, *shard.shape[1:])[:u]


def permute_shards(shard: jax.Array, u: int, axis_name: str = REPLICA) -> jax.Array:
    """Stage two by R - 1 ``ppermute`` s (shift s: this replica's share to replica i + s),
    the first ``u`` rows: :func:`gather_shards`' values and bytes. Where replicas share TPU
    slices, XLA:TPU compiles the all-gather's part inside a slice synchronous; each permute
    stays asynchronous (``docs/overlap.md``)."""
    # every replica sends the same piece to all: the exchange of R copies of the share
    copies = jnp.broadcast_to(shard, (axis_size(axis_name), *shard.shape))
    return exchange(copies, axis_name).reshape(-1, *shard.shape[1:])[:u]


GATHERS = {"all_gather": gather_shards, "permutes": permute_shards}


def staged_mean(axis_name: str = REPLICA, gather: str = "all_gather") -> Reducer:
    """The exact mean in two stages (this module): a ring all-reduce's bytes,
    ``2 (R-1)/R`` of the payload in its own dtype, each stage asynchronous on TPU.

    Each group of leaves (one leaf of two or more axes in its own shape, else its leaves
    flattened in their common dtype) is reduced along its leading axis. ``stages`` lets a
    round run the two at consecutive steps (:mod:`co2jax.comm.chunks`). ``gather``: stage
    two as one all-gather (:func:`gather_shards`) or as R - 1 permutes
    (:func:`permute_shards`, for replicas that share TPU slices).
    """
    check_axis_name("axis_name", axis_name)
    check_choice("gather", gather, tuple(GATHERS))
    gather_one = GATHERS[gather]
    name, permutes = ("staged", 1) if gather == "all_gather" else (f"staged_{gather}", 2)

    def scatter(vectors: list[jax.Array]) -> list[jax.Array]:
        return [scatter_mean(v, axis_name) for v in vectors]

    def gather(shards: list[jax.Array], rows: list[int]) -> list[jax.Array]:
        return [gather_one(s, u, axis_name) for s, u in zip(shards, rows, strict=True)]

    def reduce(payload: Payload) -> Payload:
        r = axis_size(axis_name)
        if r == 1 or not jax.tree.leaves(payload):
            return payload
        if isinstance(payload, Encoded):  # a flat encoding (one array per group)
            return payload.form.assemble(reduce_arrays(list(payload.data)))
        form, groups = Grouped.of(payload)
        arrays = [
            g[0] if len(g) == 1 and g[0].ndim >= 2 else flatten(g, common_dtype(g))[0]
            for g in groups
        ]
        return form.assemble(reduce_arrays(arrays))

    def reduce_arrays(arrays: list[jax.Array]) -> list[jax.Array]:
        return gather(scatter(arrays), [a.shape[0] for a in arrays])

    def empty(u: int, r: int, piece) -> jax.Array:
        return jnp.zeros((shard_rows(u, r), *piece.shape[1:]), piece.dtype)

    def wire(shapes, r: int) -> float:
        leaves = jax.tree.leaves(shapes)
        return ring_bytes(tree_size(shapes) * jnp.dtype(common_dtype(leaves)).itemsize, r)

    return Reducer(
        name,
        reduce,
        wire,
        pmean(axis_name).encode,  # the exact means' gather form: one flat array per group
        exact=True,
        splittable=True,
        stages=Stages(scatter, gather, empty, permutes),
    )
