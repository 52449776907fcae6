"""Pytrees as 128-lane buckets, and the gathered payload that keeps that layout.

A :class:`Layout` splits a pytree's leaves into *segments*, each updated by one kernel call:

- a leaf whose size is a multiple of 128 and spans at least ``DIRECT_MIN_BLOCKS`` blocks is
  its own *direct* segment: ``leaf.reshape(-1, 128)`` is free (a bitcast), so the kernel
  updates it in place, and a ragged last block is handled by the grid;
- every other leaf (biases, norms: small, or not a multiple of 128) goes into one *packed*
  segment per dtype signature: concatenated and zero-padded (a copy, of small leaves).

In the packed buffer that an all-gather sends (:meth:`Layout.pack`), every segment starts on
a block boundary, so the kernel reads its slice of the ``[R, rows, 128]`` gathered buffer
through its index map, without a copy. Padding costs at most one block per direct segment
(at most ``1 / DIRECT_MIN_BLOCKS`` of it) plus the packed tail.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from co2jax.kernels.spec import LANES

DIRECT_MIN_BLOCKS = 8


@dataclasses.dataclass(frozen=True)
class Segment:
    """Leaves updated by one kernel call.

    Attributes:
      leaves: indices of the leaves (in ``jax.tree.leaves`` order).
      offset_rows: where the segment starts in the packed buffer (a multiple of the block).
      rows: rows of the segment's own arrays.
      region_rows: rows reserved in the packed buffer (``rows`` rounded up to the block).
      direct: a single leaf reshaped in place (else a concatenation of small leaves).
      valid: real elements (the rest of ``rows * 128`` is padding).
    """

    leaves: tuple[int, ...]
    offset_rows: int
    rows: int
    region_rows: int
    direct: bool
    valid: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every leaf of a pytree lives in 128-lane buckets (static and hashable)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    segments: tuple[Segment, ...]
    total_rows: int
    block_rows: int

    @property
    def elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def segment(self, tree_or_leaves: Any, seg: Segment, dtype=None) -> jax.Array:
        """The ``[seg.rows, 128]`` array of ``seg`` from a tree shaped like the layout."""
        leaves = _leaves(tree_or_leaves)
        if seg.direct:
            (i,) = seg.leaves
            x = leaves[i].reshape(seg.rows, LANES)
            return x if dtype is None else x.astype(dtype)
        dtype = dtype or jnp.result_type(*(leaves[i].dtype for i in seg.leaves))
        flat = jnp.concatenate([leaves[i].astype(dtype).ravel() for i in seg.leaves])
        return jnp.pad(flat, (0, seg.rows * LANES - seg.valid)).reshape(seg.rows, LANES)

    def pack(self, tree: Any, dtype) -> jax.Array:
        """Every leaf in one ``[total_rows, 128]`` buffer of ``dtype``, segments block-aligned."""
        parts = []
        for seg in self.segments:
            x = self.segment(tree, seg, dtype).reshape(-1)
            parts.append(jnp.pad(x, (0, (seg.region_rows - seg.rows) * LANES)))
        return jnp.concatenate(parts).reshape(self.total_rows, LANES)

    def unpack(self, buffer: jax.Array, dtypes=None) -> Any:
        """The inverse of :meth:`pack` (leaf dtypes from the layout unless given)."""
        pieces = [
            buffer[s.offset_rows : s.offset_rows + s.rows].astype(jnp.float32)
            for s in self.segments
        ]
        return self.from_segments(pieces, self.dtypes if dtypes is None else dtypes)

    def from_segments(self, pieces: list[jax.Array], dtypes=None) -> Any:
        """A tree from one ``[rows, 128]`` array per segment."""
        leaves: list[Any] = [None] * len(self.shapes)
        for seg, x in zip(self.segments, pieces, strict=True):
            flat = x.reshape(-1)
            offset = 0
            for i in seg.leaves:
                n = math.prod(self.shapes[i])
                leaf = flat[offset : offset + n].reshape(self.shapes[i])
                leaves[i] = leaf if dtypes is None else leaf.astype(dtypes[i])
                offset += n
        return jax.tree.unflatten(self.treedef, leaves)


def _leaves(tree_or_leaves):
    return tree_or_leaves if isinstance(tree_or_leaves, list) else jax.tree.leaves(tree_or_leaves)


def make_layout(tree: Any, block_rows: int, signatures: Any = None) -> Layout:
    """The layout of ``tree`` (arrays or ShapeDtypeStructs) for blocks of ``block_rows`` rows.

    ``signatures`` (a tree of hashables, default the leaf dtypes) says which small leaves may
    share a packed segment: only leaves whose every buffer has the same dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> lay = make_layout({"b": jnp.zeros(3), "w": jnp.zeros((16, 128))}, block_rows=2)
      >>> [(s.leaves, s.direct, s.rows, s.offset_rows) for s in lay.segments]
      [((1,), True, 16, 0), ((0,), False, 1, 16)]
    """
    leaves, treedef = jax.tree.flatten(tree)
    sig = jax.tree.leaves(signatures) if signatures is not None else [x.dtype for x in leaves]
    shapes = tuple(tuple(x.shape) for x in leaves)
    segments, offset = [], 0
    packed: dict[Any, list[int]] = {}
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        if n % LANES == 0 and n >= DIRECT_MIN_BLOCKS * block_rows * LANES:
            rows = n // LANES
            region = -(-rows // block_rows) * block_rows
            segments.append(Segment((i,), offset, rows, region, True, n))
            offset += region
        elif n:
            packed.setdefault(str(sig[i]), []).append(i)
    for group in packed.values():
        n = sum(math.prod(shapes[i]) for i in group)
        rows = -(-n // LANES)
        region = -(-rows // block_rows) * block_rows
        segments.append(Segment(tuple(group), offset, rows, region, False, n))
        offset += region
    dtypes = tuple(str(np.dtype(x.dtype)) for x in leaves)
    return Layout(treedef, shapes, dtypes, tuple(segments), offset, block_rows)


class Part(NamedTuple):
    """One group of leaves of a :class:`Gathered` payload: its buffer ``[R, rows, 128]``,
    optional int8 ``scales`` ``[R, rows]``, its layout (over the list of the group's leaves)
    and the group's leaf indices in the whole tree."""

    buffer: jax.Array
    layout: Layout
    scales: jax.Array | None
    leaves: tuple[int, ...]


@jax.tree_util.register_pytree_node_class
class Gathered:
    """The replicas' payloads, all-gathered and not yet reduced: ``buffer`` is
    ``[R, layout.total_rows, 128]`` in the layout of :meth:`Layout.pack`.

    With ``scales`` (``[R, layout.total_rows]`` float32) the buffer holds int8 codes and
    replica r's row i is ``buffer[r, i] * scales[r, i]`` (int8 with one scale per 128-lane
    row, :func:`co2jax.kernels.quantize.quantize_int8`).

    Inside ``shard_map`` a payload whose leaves vary over different mesh axes (a data shard
    beside a whole leaf) is gathered as one buffer per group (:meth:`of_parts`): a buffer
    mixing them would type, and compute, the whole leaf as a function of the shard.

    A fused outer update reads the R payloads straight from the buffers (and scales) and
    averages them in its own pass; :meth:`mean` gives the averaged pytree for everything
    else.
    """

    def __init__(self, buffer: jax.Array, layout: Layout, scales: jax.Array | None = None):
        n = len(layout.shapes)
        self.parts = (Part(buffer, layout, scales, tuple(range(n))),)
        self.treedef = layout.treedef

    @classmethod
    def of_parts(cls, parts: list[Part], treedef: Any) -> Gathered:
        """A payload gathered as several buffers, each over the leaves ``part.leaves``."""
        out = cls.__new__(cls)
        out.parts, out.treedef = tuple(parts), treedef
        return out

    def tree_flatten(self):
        children = tuple((p.buffer, p.scales) for p in self.parts)
        aux = (tuple((p.layout, p.leaves) for p in self.parts), self.treedef)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        layouts, treedef = aux
        parts = [
            Part(b, lay, s, leaves) for (b, s), (lay, leaves) in zip(children, layouts, strict=True)
        ]
        return cls.of_parts(parts, treedef)

    def _single(self) -> Part:
        if len(self.parts) != 1:
            raise ValueError(f"this payload is gathered in {len(self.parts)} parts; read .parts")
        return self.parts[0]

    @property
    def buffer(self) -> jax.Array:
        return self._single().buffer

    @property
    def layout(self) -> Layout:
        return self._single().layout

    @property
    def scales(self) -> jax.Array | None:
        return self._single().scales

    @property
    def replicas(self) -> int:
        return self.parts[0].buffer.shape[-3]

    def decoded(self) -> jax.Array:
        """The R payloads in float32, ``[R, total_rows, 128]`` (one part only)."""
        part = self._single()
        return _decode(part)

    def mean(self) -> Any:
        """The float32 mean over replicas, as a pytree in the payload's dtypes."""
        leaves: list[Any] = [None] * self.treedef.num_leaves
        for part in self.parts:
            mean = part.layout.unpack(jnp.mean(_decode(part), axis=-3))
            for i, x in zip(part.leaves, jax.tree.leaves(mean), strict=True):
                leaves[i] = x
        return jax.tree.unflatten(self.treedef, leaves)


def _decode(part: Part) -> jax.Array:
    values = part.buffer.astype(jnp.float32)
    return values if part.scales is None else values * part.scales[..., None]


# Per-row scales travel lane-dense ([R, rows] arrays in (R, block_rows) blocks), not as a
# (rows, 1) column, which TPU tiles would pad to 128 lanes (a float32 tile row per scale: as
# many bytes as a float32 payload). Inside a kernel a transpose turns one layout into the
# other (Mosaic and Triton both lower it).


def as_column(row: jax.Array, lanes: int = LANES) -> jax.Array:
    """``(1, n)`` -> ``(n, lanes)``: row i holds element i on every lane."""
    return jnp.broadcast_to(row, (lanes, row.shape[1])).T


def as_row(column: jax.Array) -> jax.Array:
    """``(n, 1)`` -> ``(1, n)`` (a transpose of the lane broadcast; the max of equal rows,
    as Triton lowers no slice)."""
    return jnp.max(jnp.broadcast_to(column, (column.shape[0], LANES)).T, axis=0, keepdims=True)


def same_varying_axes(operands: list[jax.Array]) -> list[jax.Array] | None:
    """Inside ``shard_map`` (``check_vma=True``): the operands cast to the union of their
    varying mesh axes, so the kernel sees one type and its outputs can be declared with it.
    ``None`` outside ``shard_map`` (or when nothing varies)."""
    kinds = [getattr(jax.typeof(x), "manual_axis_type", None) for x in operands]
    if any(k is None for k in kinds):
        return None
    union = frozenset().union(*(k.varying for k in kinds))
    if not union:
        return None
    return [_varying(x, union) for x in operands]


def typed_call(call, out_shape, *operands, compiled: bool = True):
    """``call(*operands)`` of a ``pallas_call`` inside ``shard_map`` (``check_vma=True``):
    operands cast to the union of their varying mesh axes and the outputs declared with it,
    so the kernel type-checks; as it is outside ``shard_map``. A ``compiled`` kernel (not
    the interpreter) runs whole on each device (:func:`whole_per_device`)."""
    run = whole_per_device if compiled else (lambda fn, *args: fn(*args))
    cast = same_varying_axes(list(operands))
    if cast is None:
        return run(call(out_shape), *operands)
    kind = jax.typeof(cast[0]).manual_axis_type
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=kind), out_shape
    )
    # a compiled kernel's call, run whole per device by a shard_map that does not check
    # types, comes back typed as varying over none of the mesh axes: typed again as its
    # operands (a loop's carry made of it keeps its type)
    return jax.tree.map(lambda y: _varying(y, kind.varying), run(call(shapes), *cast))


def _varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` cast to varying over ``axes`` where its type does not say so already."""
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    missing = axes - (kind.varying if kind is not None else frozenset())
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def whole_per_device(fn, *operands):
    """``fn(*operands)``, a compiled kernel's call, run whole on every device of its replica.

    Inside a program mapped by hand over the replica axis only (the engines'), the other mesh
    axes are the compiler's, and a Mosaic or Triton kernel cannot be partitioned by it: the
    call is wrapped in a ``shard_map`` over those axes with every operand and result whole
    (replicated), as each device ran it before any layout split the state. Operands that
    are split over ``data`` or ``model`` are gathered for the call (the engines hand the
    kernel gathered payloads only where the outer state is whole in each replica). Outside
    such a program, ``fn(*operands)`` as it is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*operands)
    axes = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    if not axes:
        return fn(*operands)
    whole = jax.sharding.PartitionSpec()
    return jax.shard_map(
        fn, mesh=mesh, in_specs=whole, out_specs=whole, axis_names=axes, check_vma=False
    )(*operands)
