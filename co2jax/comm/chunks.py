"""A payload cut into K chunks on its wire form, each reduced on its own, equal to the whole.

A transfer spread over the inner steps (``Transfer(chunks=K)``) sends chunk c at its own
step. Chunks are cut where a reduction can be taken piece by piece and give exactly what the
whole reduction gives:

- a plain payload for an exact reducer (no codec): each :func:`co2jax.tree.varying_groups`
  group laid out as rows of ``lanes`` elements (:data:`LANES`; a leaf whose last axis is a
  multiple of it keeps its rows, the other leaves are packed together), padded and cut into
  K blocks of rows; a chunk is a ``[rows, lanes]`` array. A flat vector would cost XLA:TPU
  a relayout of the whole payload into and out of a one-dimensional tiling, which compiled
  about 3.5x slower (docs/overlap.md);
- a plain payload for a compressed reducer: each group flattened (in its leaves'
  common dtype), padded and cut into K ranges of a whole number of the reducer's codec blocks
  (a top-k codec's chunks); each piece is reduced by the reducer itself. Where every leaf of
  a group is row-shaped and the codec's blocks tile a row (int8 in blocks of 128, rows of
  1024), the group is laid out in rows as an exact payload's, which holds its elements in
  the flat order, so the same blocks: a flat vector of the whole payload cost XLA:TPU a
  relayout (the plain int8 round at 25M compiled 2.2x slower, with 1.7x the temporaries).
  An exact mean is element-wise, a block codec quantizes each block on its own and top-k
  selects per chunk, and the two-step compressed all-reduce cuts a piece into shards of
  whole blocks (so it reduces block by block, both quantizations in the whole payload's
  blocks): the pieces reduce to exactly the whole's values (the ring sums in another order:
  close, not equal);
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
  >>> jax.jit(jax.vmap(spread, axis_name="replica"))(two)["a"][0]
  Array([0. , 0.5, 1. , 1.5, 2. ], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import Encoded, Grouped, Reducer, values
from co2jax.tree import common_dtype, flatten

LANES = 1024
"""Row width of an exact reducer's chunks: a multiple of every TPU tiling's lane count."""
MIN_ROWS = 64
"""A group is cut in rows when each chunk holds at least this many (padding <= 1/32)."""


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
      lanes: per group, its rows' width (0: a flat vector).
      rows: per group with lanes: its row-shaped leaves' rows, then the packed rest's.
      shards: the devices of one replica each chunk is split over (:func:`reduce`): each
        sends only its 1/shards of the chunk over the replica axis (1: every device sends
        the whole chunk).
    """

    chunks: int
    form: Any
    encoded: bool
    per_unit: tuple[int, ...]
    units: tuple[int, ...]
    dtypes: tuple[Any, ...]
    piece_form: Any = None
    lanes: tuple = ()
    rows: tuple = ()
    shards: int = 1

    def elements(self, g: int) -> int:
        """Elements of group ``g`` in one chunk."""
        return self.units[g] * self.per_unit[g]

    def piece_shape(self, g: int) -> tuple[int, ...]:
        """The shape of group ``g``'s part of one chunk."""
        lanes = self.lanes[g] if self.lanes else 0
        return (self.units[g], lanes) if lanes else (self.elements(g),)


def _blocks_tile(reducer: Reducer, lanes: int) -> bool:
    """A compressed reducer whose codec blocks tile a row of ``lanes`` and that reduces a
    chunk whole (no stages): its chunk may be rows, each a whole number of blocks, in the
    order a flat vector of the group's leaves has them, where every leaf is in rows."""
    block = reducer.codec.block
    return bool(block) and lanes % block == 0 and reducer.stages is None


def _row_shaped(shape: tuple, lanes: int) -> bool:
    return len(shape) >= 2 and shape[-1] % lanes == 0


def _row_plan(form: Grouped, group: tuple, lanes: int) -> tuple:
    """((leaf, rows) for each row-shaped leaf, (the other leaves, packed: their rows))."""
    shaped = tuple(
        (i, math.prod(form.shapes[i]) // lanes) for i in group if _row_shaped(form.shapes[i], lanes)
    )
    rest = tuple(i for i in group if not _row_shaped(form.shapes[i], lanes))
    packed = math.ceil(sum(math.prod(form.shapes[i]) for i in rest) / lanes)
    return shaped, (rest, packed)


SUBLANES = 8
"""Rows of a TPU tile: a chunk's rows on each device, and each replica's share of them in a
staged reduction, are whole tiles where the padding costs little (:func:`_row_units`)."""


def _row_units(count: int, shards: int, replicas: int) -> int:
    """Rows of one chunk of a group in rows, for ``count`` rows needed: a whole number per
    device (``shards``), in whole tiles per device and per replica's share of them
    (``replicas``: a staged reducer's) where that pads by at most 1/64, else in whole tiles
    per device where that does, else as few as whole rows per device allow.

    Compiled for TPU, rows that were not whole tiles cost XLA:TPU's code generation about
    10x: 100M parameters, R = 4 on a v5e 4x4 slice, 3 chunks, an all-gather: 62 CPU-s against
    6 in whole tiles; the staged mean at 4 steps 70 s against 7 with whole tiles per share
    (``docs/overlap.md``)."""
    for align in (SUBLANES * max(1, replicas), SUBLANES, 1):
        step = shards * align
        if align == 1 or count >= 64 * step:
            return -(-count // step) * step
    raise AssertionError("unreachable")


def plan(
    payload: Any,
    reducer: Reducer,
    chunks: int,
    lanes: int | None = None,
    shards: int = 1,
    replicas: int = 1,
) -> Plan:
    """The cut of ``payload`` (arrays or ShapeDtypeStructs; plain or encoded) into ``chunks``;
    ``lanes``: the row width of an exact reducer's chunks (default: :data:`LANES` for each
    group of at least :data:`MIN_ROWS` rows a chunk, else flat; 0: all flat), and of a
    compressed reducer's whose codec blocks tile a row, for the groups whose every leaf is
    row-shaped.

    ``shards``: the devices inside one replica (its ``data`` x ``model`` axes) that a chunk
    may be split over before it crosses the replica axis (:func:`reduce`); each group's
    chunk is padded to a multiple of ``shards`` units (rows, or codec blocks): an exact mean
    is element-wise and a codec encodes each block on its own (a scale per block, a top-k
    per block), so each device reducing its whole units gives the whole chunk's values. An
    encoded payload (error feedback's) is split along its wire arrays' units the same way.
    Only a driver that knows the reducer is ``splittable`` asks for ``shards > 1``.
    ``replicas``: R, for a staged reducer (its ``stages`` set) whose stages split each
    chunk's rows over the replicas: a chunk in rows is cut so that each share is whole TPU
    tiles (:func:`_row_units`)."""
    if isinstance(payload, Encoded):
        form = payload.form
        per_unit = [form.per_unit] * len(form.groups)
        dtypes = [jnp.float32] * len(form.groups)
    else:
        form, groups = Grouped.of(payload)
        block = reducer.codec.block if reducer.codec is not None else None
        per_unit = [block or 1] * len(form.groups)
        dtypes = [common_dtype(g) for g in groups]
    encoded, sizes = isinstance(payload, Encoded), form.sizes()
    in_rows = lambda w: not encoded and (reducer.codec is None or _blocks_tile(reducer, w))
    if lanes and not in_rows(lanes):
        raise ValueError(
            f"lanes={lanes}: rows are for a plain payload of an exact reducer, or of a "
            "compressed one whose codec blocks tile a row"
        )
    if lanes is None:
        lanes = LANES if in_rows(LANES) else 0
        widths = [lanes if n >= MIN_ROWS * lanes * chunks else 0 for n in sizes]
    else:
        widths = [lanes] * len(sizes)
    if reducer.codec is not None:  # a codec's blocks in the flat order: every leaf in rows
        widths = [
            w if w and all(_row_shaped(form.shapes[i], w) for i in group) else 0
            for w, group in zip(widths, form.groups, strict=True)
        ]
    rows = tuple(
        _row_plan(form, group, w) if w else None
        for group, w in zip(form.groups, widths, strict=True)
    )
    units = []
    staged = replicas if reducer.stages is not None else 1
    for g, n in enumerate(sizes):
        if widths[g]:
            per_unit[g] = widths[g]
            shaped, (_, packed) = rows[g]
            count = math.ceil((sum(r for _, r in shaped) + packed) / chunks)
            units.append(_row_units(count, shards, staged))
        else:
            count = math.ceil(math.ceil(n / per_unit[g]) / chunks)
            units.append(-(-count // shards) * shards)  # a whole number of units per device
    out = Plan(chunks, form, encoded, tuple(per_unit), tuple(units), tuple(dtypes), None)
    out = out._replace(lanes=tuple(widths), rows=rows, shards=shards)
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


def _to_rows(plan: Plan, g: int, leaves: list) -> jax.Array:
    """Group ``g``'s leaves (all of the payload's) as ``[K * units, lanes]`` rows."""
    shaped, (rest, _) = plan.rows[g]
    dtype, lanes = plan.dtypes[g], plan.lanes[g]
    parts = [leaves[i].astype(dtype).reshape(-1, lanes) for i, _ in shaped]
    if rest:
        flat = jnp.concatenate([leaves[i].astype(dtype).ravel() for i in rest])
        parts.append(jnp.pad(flat, (0, (-flat.size) % lanes)).reshape(-1, lanes))
    block = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return jnp.pad(block, ((0, plan.chunks * plan.units[g] - block.shape[0]), (0, 0)))


def _from_rows(plan: Plan, g: int, block: jax.Array, leaves: list) -> None:
    """The leaves of group ``g`` from its ``[rows, lanes]`` block, written into ``leaves``."""
    form, (shaped, (rest, packed)) = plan.form, plan.rows[g]
    offset = 0
    for i, r in shaped:
        leaves[i] = block[offset : offset + r].reshape(form.shapes[i]).astype(form.dtypes[i])
        offset += r
    flat = block[offset : offset + packed].reshape(-1)
    offset = 0
    for i in rest:
        n = math.prod(form.shapes[i])
        leaves[i] = flat[offset : offset + n].reshape(form.shapes[i]).astype(form.dtypes[i])
        offset += n


def split(plan: Plan, payload: Any) -> list:
    """The payload as K chunks: per group, its wire arrays padded and reshaped to
    ``[K, rows, ...]`` along their leading axis (plain: one flat vector per group, or rows of
    ``lanes``)."""
    if plan.encoded:
        wire = list(payload.data)
    else:
        leaves, (_, groups) = jax.tree.leaves(payload), Grouped.of(payload)
        wire = [
            None if plan.lanes[g] else flatten(group, plan.dtypes[g])[0]
            for g, group in enumerate(groups)
        ]
    sizes = plan.form.sizes()
    out = []
    for g, arrays in enumerate(wire):
        if arrays is None:  # in rows
            rows = _to_rows(plan, g, leaves)
            out.append(rows.reshape(plan.chunks, plan.units[g], plan.lanes[g]))
            continue
        total = math.ceil(sizes[g] / plan.per_unit[g])  # units of the whole group

        def cut(a, g=g, total=total):
            # a plain vector's rows are elements; an encoding's leading axis holds a whole
            # number of rows per unit (1, or a top-k's k values), and may carry padding units
            # beyond the payload (a kernel's tile of blocks): those are dropped
            per = a.shape[0] // total
            rows = plan.units[g] * per if plan.encoded else plan.elements(g)
            if plan.encoded:
                a = a[: total * per]
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
    (averaged here when the reducer hands the replicas' pieces over un-reduced).

    With ``plan.shards > 1`` the chunk is split along its rows over the replica's own axes
    (every mesh axis but ``replica`` with more than one device, manual for this reduction
    only): each device sends its slice over the replica axis, and the compiler gathers the
    reduced slices inside the replica (its fast links) where the whole chunk is read. Left to
    the compiler, a chunk replicated inside the replica crosses the replica axis once per
    device (measured on TPU AOT: ``docs/overlap.md``)."""
    whole = lambda p, at: list(values(reducer.reduce(as_payload(at, p))))
    return _per_device(plan, whole, piece)


def _per_device(plan: Plan, fn, tree: list) -> list:
    """``fn(tree, plan)`` on the whole chunk, or with ``plan.shards > 1`` on each device's
    slice of it (its rows; :func:`reduce`), each group's result split the same way."""
    if plan.shards == 1:
        return fn(tree, plan)
    mesh = jax.sharding.get_abstract_mesh()
    inner = tuple(a for a in mesh.axis_names if a != REPLICA and mesh.shape[a] > 1)
    if math.prod(mesh.shape[a] for a in inner) != plan.shards:
        raise ValueError(
            f"a chunk split over {plan.shards} devices, but the mesh's axes {inner} hold "
            f"{math.prod(mesh.shape[a] for a in inner)}"
        )
    local = plan  # what one device holds: 1/shards of each group's units
    if plan.encoded:
        shapes = tuple((plan.elements(g) // plan.shards,) for g in range(len(plan.units)))
        local = plan._replace(piece_form=dataclasses.replace(plan.piece_form, shapes=shapes))
    split = jax.sharding.PartitionSpec(inner)
    return jax.shard_map(
        lambda t: fn(t, local),
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: split, list(tree)),),
        out_specs=[split] * len(plan.units),  # a prefix: every array of a group's result
        axis_names=set(inner),
    )(list(tree))


def _local_rows(plan: Plan, g: int) -> int:
    """Rows (units, or elements of a flat vector) of group ``g``'s chunk on one device."""
    rows = plan.units[g] if plan.lanes and plan.lanes[g] else plan.elements(g)
    return rows // plan.shards


def scatter(plan: Plan, reducer: Reducer, piece: list) -> list[jax.Array]:
    """Stage one of a staged reducer (:mod:`co2jax.comm.staged`) on one chunk: per group,
    this replica's share of the chunk's mean (per device with ``plan.shards > 1``)."""
    return _per_device(plan, lambda p, _: reducer.stages.scatter(list(p)), piece)


def gather(plan: Plan, reducer: Reducer, shards: list) -> list[jax.Array]:
    """Stage two: the shares of one chunk gathered into its reduced vectors."""
    rows = [_local_rows(plan, g) for g in range(len(plan.units))]
    return _per_device(plan, lambda s, _: reducer.stages.gather(list(s), rows), shards)


def shard_zeros(plan: Plan, replicas: int, stages: Any) -> list:
    """Per group, a zero share of one piece (what a staged transfer gathers at its first
    step, before any piece is scattered), as the scatter returns it: one device's share
    (``stages.empty``) with each array's leading axis times ``plan.shards``, as the
    devices' shares stand side by side (:func:`_per_device`)."""
    out = []
    for g in range(len(plan.units)):
        rows = _local_rows(plan, g)
        piece = jax.ShapeDtypeStruct((rows, *plan.piece_shape(g)[1:]), plan.dtypes[g])
        local = stages.empty(rows, replicas, piece)
        whole = lambda z: jnp.zeros((z.shape[0] * plan.shards, *z.shape[1:]), z.dtype)
        out.append(jax.tree.map(whole, local))
    return out


def pieces(reducer: Reducer | None, slots: int) -> int:
    """The pieces a payload spread over ``slots`` consecutive steps is cut into: one per
    step; for a staged reducer (its ``stages`` set), one fewer, piece c scattered at step c
    and gathered at step c + 1 (:func:`reduce_chunk`), so that every stage runs inside a
    step of one loop body.

    Example:
      >>> from co2jax.comm import exact_mean
      >>> pieces(exact_mean("all_gather"), 4), pieces(exact_mean("staged"), 4)
      (4, 3)
    """
    staged = reducer is not None and reducer.stages is not None
    return slots - 1 if staged and slots > 1 else slots


def piece_values(plan: Plan, piece: list) -> list[jax.Array]:
    """One chunk's own values (decoded, for an encoded payload), per group."""
    if not plan.encoded:
        return list(piece)
    return list(Encoded(tuple(piece), plan.piece_form).decode())


def zeros(plan: Plan) -> list[jax.Array]:
    """The reduced values of every chunk, per group ``[K, *piece_shape]``, before any arrives."""
    return [
        jnp.zeros((plan.chunks, *plan.piece_shape(g)), plan.dtypes[g])
        for g in range(len(plan.units))
    ]


def put(acc: list, c: Any, vectors: list) -> list:
    """``acc`` with chunk ``c``'s reduced vectors written in."""
    return [
        jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), c, 0)
        for a, v in zip(acc, vectors, strict=True)
    ]


def finish(plan: Plan, acc: list) -> Any:
    """The reduced payload, shaped and typed as the whole reduction's, from every chunk."""
    form, leaves = plan.form, [None] * len(plan.form.shapes)
    if not any(plan.lanes):
        return form.assemble([a.reshape(-1)[:n] for a, n in zip(acc, form.sizes(), strict=True)])
    for g, a in enumerate(acc):  # a plain payload, some groups in rows
        if plan.lanes[g]:
            _from_rows(plan, g, a.reshape(-1, plan.lanes[g]), leaves)
            continue
        vector, offset = a.reshape(-1), 0
        for i in form.groups[g]:
            n = math.prod(form.shapes[i])
            leaves[i] = vector[offset : offset + n].reshape(form.shapes[i]).astype(form.dtypes[i])
            offset += n
    return jax.tree.unflatten(form.treedef, leaves)


class Buffer(NamedTuple):
    """A payload in flight in chunks, between its send and its apply.

    Attributes:
      wire: per group, the payload's chunks (:func:`split`, ``[K, ...]``); a plain payload's
        chunk is replaced by its reduction once reduced (no second buffer).
      acc: per group, an encoded payload's reduced chunks (:func:`zeros`, ``[K, ...]``);
        ``None`` for a plain payload.
      shard: staged (:func:`fill` given a staged reducer): per group, this replica's share of
        the piece scattered at the step before, gathered at the next (:func:`reduce_chunk`);
        zeros before the first step; ``None`` for any other reducer.
    """

    wire: list
    acc: list | None
    shard: list | None = None


def fill(plan: Plan, payload: Any, like=None, reducer: Reducer | None = None) -> Buffer:
    """The buffer of ``payload`` before any chunk is reduced. ``like(zeros, refs)`` types an
    encoded payload's accumulator as its wire arrays (a loop's carry keeps its types).
    ``reducer``: a staged one (its ``stages`` set; a plain payload) is run in its two
    stages at consecutive steps (:func:`reduce_chunk`); any other, or none, whole."""
    wire = split(plan, payload)
    if not plan.encoded:
        if reducer is None or reducer.stages is None:
            return Buffer(wire, None)
        shard = shard_zeros(plan, axis_size(REPLICA), reducer.stages)  # gathered at step 0
        if like is not None:  # every array of a group's share typed as its wire array
            refs = [jax.tree.leaves(w)[0] for w in wire]
            shard = [
                like(s, jax.tree.map(lambda _, r=r: r, s)) for s, r in zip(shard, refs, strict=True)
            ]
        return Buffer(wire, None, shard)
    if reducer is not None and reducer.stages is not None:
        raise ValueError(f"reducer {reducer.name!r}: its two stages take a plain payload")
    acc = zeros(plan)
    if like is not None:
        acc = like(acc, [jax.tree.leaves(w)[0] for w in wire])
    return Buffer(wire, acc)


def reduce_chunk(plan: Plan, reducer: Reducer, buffer: Buffer, c: Any) -> tuple:
    """Chunk ``c`` of ``buffer`` reduced: ``(buffer, piece, reduced)`` with the reduction
    written in, the chunk as sent, and its reduced vectors.

    Staged (``buffer.shard`` set; :func:`fill` given a staged reducer): ``plan.chunks = K``
    pieces over steps ``c = 0..K``, every step alike (one loop body): step ``c`` gathers
    piece ``c - 1`` (scattered at the step before) and scatters piece ``c``, two
    collectives that do not wait on each other, and returns piece ``c - 1`` as sent and
    reduced. Step 0 gathers the zero share :func:`fill` holds and step K scatters piece
    K - 1 again, half a piece's ring bytes each spent for nothing, their results unused:
    ``(K + 1) / K`` of a ring all-reduce's bytes in all (:func:`pieces`)."""
    if buffer.shard is not None:
        k = plan.chunks
        first = c == 0
        # piece c read apart from the write below: fused with it (one loop fusion on TPU),
        # the scatter waited for the gather's done, after the step's compute
        ahead, wire = jax.lax.optimization_barrier(
            (take(buffer.wire, jnp.minimum(c, k - 1)), buffer.wire)
        )
        shard = scatter(plan, reducer, ahead)
        arrived = gather(plan, reducer, buffer.shard)
        before = jnp.maximum(c - 1, 0)
        held = take(wire, before)  # piece c - 1 as sent (at c = 0: piece 0, kept)
        kept = [jnp.where(first, h, a.astype(h.dtype)) for a, h in zip(arrived, held, strict=True)]
        sent = [h * (1 - jnp.asarray(first, h.dtype)) for h in held]
        return Buffer(put(wire, before, kept), None, shard), sent, arrived
    piece = take(buffer.wire, c)
    reduced = reduce(plan, reducer, piece)
    if plan.encoded:
        return buffer._replace(acc=put(buffer.acc, c, reduced)), piece, reduced
    return buffer._replace(wire=put(buffer.wire, c, reduced)), piece, reduced


def result(plan: Plan, buffer: Buffer) -> Any:
    """The reduced payload once every chunk of ``buffer`` is reduced (a staged buffer's
    K + 1 steps run)."""
    return finish(plan, buffer.acc if plan.encoded else buffer.wire)
