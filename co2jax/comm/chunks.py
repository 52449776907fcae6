"""A payload cut into K chunks on its wire form, each reduced on its own, equal to the whole.

A transfer spread over the inner steps (``Transfer(chunks=K)``) sends chunk c at its own
step. Chunks are cut where a reduction can be taken piece by piece and give exactly what the
whole reduction gives:

- a plain payload: each :func:`co2jax.tree.varying_groups` group flattened (in its leaves'
  common dtype), padded and cut into K ranges of a whole number of the reducer's codec blocks
  (a top-k codec's chunks); each piece is reduced by the reducer itself. An exact mean is
  element-wise, a block codec quantizes each block on its own and top-k selects per chunk,
  so the pieces reduce to exactly the whole's values (the ring sums in another order, and the
  two-step compressed all-reduce re-quantizes each piece's mean on its own shards: close,
  not equal);
- a payload already encoded (:class:`~co2jax.comm.Encoded`, what error feedback sends): the
  arrays of each group's wire form cut along their leading axis (blocks), all-gathered and
  averaged per group by the form.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from co2jax.comm import chunks, pmean
  >>> reducer = pmean()
  >>> plan = chunks.plan({"a": jnp.arange(5.0)}, reducer, 2)
  >>> def spread(payload):
  ...     buffer, acc = chunks.split(plan, payload), chunks.zeros(plan)
  ...     for c in range(2):  # each chunk reduced on its own (at its own step, in a round)
  ...         acc = chunks.put(acc, c, chunks.reduce(plan, reducer, chunks.take(buffer, c)))
  ...     return chunks.finish(plan, acc)
  >>> two = {"a": jnp.stack([jnp.arange(5.0), jnp.zeros(5)])}
  >>> jax.vmap(spread, axis_name="replica")(two)["a"][0]
  Array([0. , 0.5, 1. , 1.5, 2. ], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax.comm.reducer import Encoded, Grouped, Reducer, values
from co2jax.tree import common_dtype, flatten


class Plan(NamedTuple):
    """How a payload of given shapes is cut (static).

    Attributes:
      chunks: K.
      form: the payload's grouping (``Grouped``) or, encoded, its wire form.
      encoded: the payload is :class:`~co2jax.comm.Encoded`.
      per_unit: elements per unit of each group (the codec block a cut respects).
      units: units of each group in one chunk.
      dtypes: the dtype each group's values are accumulated in.
      piece_form: encoded: the wire form of one chunk (one vector per group).
    """

    chunks: int
    form: Any
    encoded: bool
    per_unit: tuple[int, ...]
    units: tuple[int, ...]
    dtypes: tuple[Any, ...]
    piece_form: Any = None

    def elements(self, g: int) -> int:
        """Elements of group ``g`` in one chunk."""
        return self.units[g] * self.per_unit[g]


def plan(payload: Any, reducer: Reducer, chunks: int) -> Plan:
    """The cut of ``payload`` (arrays or ShapeDtypeStructs; plain or encoded) into ``chunks``."""
    if isinstance(payload, Encoded):
        form = payload.form
        per_unit = [form.per_unit] * len(form.groups)
        dtypes = [jnp.float32] * len(form.groups)
    else:
        form, groups = Grouped.of(payload)
        block = reducer.codec.block if reducer.codec is not None else None
        per_unit = [block or 1] * len(form.groups)
        dtypes = [common_dtype(g) for g in groups]
    sizes = form.sizes()
    units = [math.ceil(math.ceil(n / u) / chunks) for n, u in zip(sizes, per_unit, strict=True)]
    out = Plan(
        chunks, form, isinstance(payload, Encoded), tuple(per_unit), tuple(units), tuple(dtypes)
    )
    if not out.encoded:
        return out
    count = len(form.groups)
    piece_form = dataclasses.replace(
        form,
        treedef=jax.tree.structure([0] * count),
        shapes=tuple((out.elements(g),) for g in range(count)),
        dtypes=("float32",) * count,
        groups=tuple((g,) for g in range(count)),
    )
    return out._replace(piece_form=piece_form)


def split(plan: Plan, payload: Any) -> list:
    """The payload as K chunks: per group, its wire arrays padded and reshaped to
    ``[K, rows, ...]`` along their leading axis (plain: one flat vector per group)."""
    if plan.encoded:
        wire = list(payload.data)
    else:
        _, groups = Grouped.of(payload)
        wire = [flatten(g, dt)[0] for g, dt in zip(groups, plan.dtypes, strict=True)]
    sizes = plan.form.sizes()
    out = []
    for g, arrays in enumerate(wire):
        total = math.ceil(sizes[g] / plan.per_unit[g])  # units of the whole group

        def cut(a, g=g, total=total):
            # a plain vector's rows are elements; an encoding's leading axis holds a whole
            # number of rows per unit (1, or a top-k's k values)
            rows = plan.units[g] * (a.shape[0] // total) if plan.encoded else plan.elements(g)
            pad = [(0, plan.chunks * rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
            return jnp.pad(a, pad).reshape(plan.chunks, rows, *a.shape[1:])

        out.append(jax.tree.map(cut, arrays))
    return out


def take(buffer: list, c: Any) -> list:
    """Chunk ``c`` (a Python int or a traced index) of a :func:`split` buffer."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), buffer)


def as_payload(plan: Plan, piece: list) -> Any:
    """One chunk as what the reducer takes: a list of vectors, or an :class:`Encoded`."""
    return Encoded(tuple(piece), plan.piece_form) if plan.encoded else list(piece)


def reduce(plan: Plan, reducer: Reducer, piece: list) -> list[jax.Array]:
    """One chunk reduced over the replica axis: per group, a vector of its chunk's elements
    (averaged here when the reducer hands the replicas' pieces over un-reduced)."""
    return list(values(reducer.reduce(as_payload(plan, piece))))


def piece_values(plan: Plan, piece: list) -> list[jax.Array]:
    """One chunk's own values (decoded, for an encoded payload), per group."""
    if not plan.encoded:
        return list(piece)
    return list(Encoded(tuple(piece), plan.piece_form).decode())


def zeros(plan: Plan) -> list[jax.Array]:
    """The reduced values of every chunk, per group ``[K, elements]``, before any arrives."""
    return [
        jnp.zeros((plan.chunks, plan.elements(g)), plan.dtypes[g]) for g in range(len(plan.units))
    ]


def put(acc: list, c: Any, vectors: list) -> list:
    """``acc`` with chunk ``c``'s reduced vectors written in."""
    return [
        jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), c, 0)
        for a, v in zip(acc, vectors, strict=True)
    ]


def finish(plan: Plan, acc: list) -> Any:
    """The reduced payload, shaped and typed as the whole reduction's, from every chunk."""
    sizes = plan.form.sizes()
    return plan.form.assemble([a.reshape(-1)[:n] for a, n in zip(acc, sizes, strict=True)])
