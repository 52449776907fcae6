"""The :class:`Reducer` type, payloads in their wire form (:class:`Encoded`), and the exact means.

A reducer maps this replica's payload pytree to the replicas' reduced payload (inside an axis
named like its ``axis_name``: ``jax.vmap(..., axis_name=...)`` or ``jax.shard_map``). The
exact means differ only in how the compiler can schedule them (``docs/overlap.md``):

- :func:`pmean` (``lax.pmean``, an all-reduce): the default; XLA:TPU schedules it
  synchronously after an independent loop, so it cannot hide behind the inner steps there.
- :func:`all_gather_mean`: an all-gather of the payload then a local float32 sum. XLA:TPU
  issues it as an asynchronous start/done pair around an independent loop. Each replica
  receives (R-1) payloads, versus 2(R-1)/R for a ring all-reduce: best for small R.
- :func:`ring_mean`: a ring of ``ppermute`` steps (reduce-scatter then all-gather, R-1 steps
  each) on the flattened payload, summed in float32.
- :func:`co2jax.comm.staged.staged_mean`: a reduce-scatter by direct sends, then an
  all-gather: the ring's bytes in two asynchronous stages, which a round may run at
  consecutive inner steps.
- :func:`all_gather_stacked`: the all-gather left un-reduced (:class:`co2jax.kernels.Gathered`),
  for an outer update that averages the R payloads in its own pass.

A reducer with a *gather form* (``encode`` set) is an all-gather of ``encode(payload)``
followed by ``Encoded.combine()``: a driver that runs each replica as its own job exchanges
the encoded payloads and combines them the same way. Inside ``shard_map`` every packing
reducer packs each group of leaves that vary over the same mesh axes on its own
(:func:`co2jax.tree.varying_groups`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.packing import pack_rows, unpack_rows
from co2jax.kernels import quantize as qk
from co2jax.kernels.api import gather_layout
from co2jax.kernels.layout import Gathered, Part
from co2jax.kernels.spec import LANES
from co2jax.tree import (
    by_varying_axes,
    common_dtype,
    flatten,
    tree_bytes,
    tree_size,
    varying_axes,
    varying_groups,
)

Payload = Any


class Reducer(NamedTuple):
    """A cross-replica reduction and what a driver needs to know about it.

    Attributes:
      name: what it is (``"pmean"``, ``"all_gather_compressed(int8)"``, ...).
      reduce: ``reduce(payload) -> reduced``, inside the replica axis: the mean as a pytree
        shaped like the payload, or (``gathered``) the replicas' payloads un-reduced as
        :class:`co2jax.kernels.Gathered`. Also takes the payload already encoded
        (:class:`Encoded`, what error feedback sends).
      wire_bytes: ``wire_bytes(shapes, replicas) -> float``: bytes one replica sends to
        reduce a payload of these shapes (arrays or ShapeDtypeStructs) over R replicas.
      encode: the gather form: ``encode(payload) -> Encoded``, what one replica puts on the
        wire; ``Encoded.combine()`` of the R replicas' encodings stacked on a leading axis is
        the reduced value. ``None`` for a reduction with no such form (the two-step
        compressed all-reduce).
      codec: the compression format (:class:`co2jax.comm.Codec`), ``None`` when exact.
      gathered: ``reduce`` returns :class:`co2jax.kernels.Gathered`.
      exact: the element-wise mean itself: a driver may swap it for another exact mean.
      chunkable: its payload can be cut into chunks reduced one by one (a spread schedule);
        False for encodings that stand only whole (low-rank factors, a per-tensor quantizer):
        a driver then sends the transfer whole unless asked to spread, and refuses if asked.
      reach: whose payloads a replica receives: ``"all"`` (every replica's: a mean, a
        gather) or ``"group"`` (its group mates' only: gossip), which has no all-replica
        reduction to weight or to exchange between jobs.
      splittable: reducing any whole units of the payload (elements, or the codec's blocks)
        on their own gives those units of the whole reduction: an exact mean, or a gather of
        a codec that encodes each block on its own. A driver may then split a payload over
        a replica's devices (:func:`co2jax.comm.chunks.reduce`).
      stages: a reduction in two stages that a round may run at consecutive steps
        (:class:`co2jax.comm.staged.Stages`: a reduce-scatter, then an all-gather);
        ``reduce`` runs both. ``None`` for a reduction in one collective.
      roundtrip: for a compressed reducer without a gather form (the two-step compressed
        all-reduce), ``roundtrip(payload) -> payload``: the values one replica's payload is
        transmitted as (its encoding decoded, in the reducer's own block layout), shaped like
        the payload; reduced, they encode to the same codes. What error feedback sends and
        subtracts (with a gather form it sends ``encode(payload)`` itself).
    """

    name: str
    reduce: Callable[[Payload], Any]
    wire_bytes: Callable[[Any, int], float]
    encode: Callable[[Payload], Encoded] | None = None
    codec: Any = None
    gathered: bool = False
    exact: bool = False
    chunkable: bool = True
    reach: str = "all"
    splittable: bool = False
    unfused: Any = None
    roundtrip: Callable[[Payload], Payload] | None = None
    stages: Any = None

    def __call__(self, payload: Payload) -> Any:
        return self.reduce(payload)


@jax.tree_util.register_pytree_node_class
class Encoded:
    """A payload in its wire form: arrays (``data``) and the static ``form`` that decodes
    them. ``combine()`` reduces R encodings stacked on a leading axis; ``decode()`` is one."""

    def __init__(self, data: Any, form: Any):
        self.data, self.form = data, form

    def tree_flatten(self):
        return (self.data,), self.form

    @classmethod
    def tree_unflatten(cls, form, children):
        return cls(children[0], form)

    def combine(self, weights: jax.Array | None = None) -> Any:
        """The reduced value; with ``weights`` ([R], >= 0, not all 0) the replicas' weighted
        combination (:mod:`co2jax.comm.participation`: a weight of 0 leaves a replica out)."""
        if weights is None:
            return self.form.combine(self.data)
        return self.form.combine(self.data, weights)

    def decode(self) -> Any:
        """This one payload's decoded values, as a pytree shaped like the payload."""
        return values(self.form.combine(jax.tree.map(lambda x: x[None], self.data)))


def values(x: Any) -> Any:
    """The values a payload or a reduced payload stands for: an :class:`Encoded` decoded, a
    :class:`~co2jax.kernels.Gathered` averaged, anything else as it is."""
    if isinstance(x, Encoded):
        return x.decode()
    if isinstance(x, Gathered):
        return x.mean()
    return x


@dataclasses.dataclass(frozen=True)
class Grouped:
    """The static description of a payload cut into :func:`co2jax.tree.varying_groups`."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tree: Any) -> tuple[Grouped, list[list[jax.Array]]]:
        leaves, treedef = jax.tree.flatten(tree)
        groups = varying_groups(leaves)
        form = cls(
            treedef,
            tuple(tuple(x.shape) for x in leaves),
            tuple(str(jnp.dtype(x.dtype)) for x in leaves),
            groups,
        )
        return form, [[leaves[i] for i in g] for g in groups]

    def fields(self) -> tuple:
        return self.treedef, self.shapes, self.dtypes, self.groups

    def sizes(self) -> list[int]:
        """Elements of each group."""
        return [sum(math.prod(self.shapes[i]) for i in g) for g in self.groups]

    per_unit = 1
    """Elements per leading-axis unit of a group's wire arrays (a codec's block)."""
    per_index = False
    """Combined per index over the replicas that sent it (a contributor mean), not as a mean
    of the replicas' decoded payloads."""

    def mean(self, data, sizes: list[int], weights=None) -> list[jax.Array]:
        """Per group, the float32 mean of R wire forms stacked on a leading axis, as a vector
        of ``sizes[g]`` elements (a group's whole, or the units of one chunk of it); with
        ``weights`` ([R]) the weighted mean."""
        raise NotImplementedError(f"{type(self).__name__} has no per-group mean")

    def combine(self, data, weights=None) -> Any:
        return self.assemble(self.mean(data, self.sizes(), weights))

    def assemble(self, vectors: list[jax.Array]) -> Any:
        """The tree from one float32 vector per group (cast to the leaves' dtypes)."""
        leaves: list[Any] = [None] * len(self.shapes)
        for group, vector in zip(self.groups, vectors, strict=True):
            if vector.ndim != 1:  # a group of one leaf, sent in its own shape
                (i,) = group
                leaves[i] = vector.reshape(self.shapes[i]).astype(self.dtypes[i])
                continue
            offset = 0
            for i in group:
                n = math.prod(self.shapes[i])
                leaves[i] = (
                    vector[offset : offset + n].reshape(self.shapes[i]).astype(self.dtypes[i])
                )
                offset += n
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class _Flat(Grouped):
    """Each group as one vector of its leaves' common dtype; combined by a float32 mean."""

    def mean(self, data, sizes, weights=None):
        means = [weighted_mean(v.astype(jnp.float32), weights) for v in data]
        return [m[:n] if m.ndim == 1 else m for m, n in zip(means, sizes, strict=True)]


def weighted_mean(stacked: jax.Array, weights: jax.Array | None) -> jax.Array:
    """The mean over the leading (replica) axis; with ``weights`` ([R]) the weighted mean
    ``sum_r w_r x_r / sum_r w_r``."""
    if weights is None:
        return jnp.mean(stacked, axis=0)
    w = weights.astype(stacked.dtype).reshape((-1,) + (1,) * (stacked.ndim - 1))
    return jnp.sum(w * stacked, axis=0) / jnp.sum(weights).astype(stacked.dtype)


def per_contributor(total: jax.Array, count: jax.Array) -> jax.Array:
    """``total / count`` where some replica contributed (``count > 0``, a weighted count may
    be below 1), 0 elsewhere: the per-index mean over the replicas that sent the index."""
    some = count > 0
    return jnp.where(some, total / jnp.where(some, count, 1.0), 0.0)


def check_whole_leaves(groups: list[list[jax.Array]], axis_name: str, what: str) -> None:
    """Raises ``ValueError`` when a payload leaf varies over a mesh axis besides
    ``axis_name`` (inside ``shard_map``: a data shard), for an encoding computed per whole
    tensor (``what`` says which: its factors, its top-k and norm are another algorithm's on a
    shard)."""
    for leaves in groups:
        axes = varying_axes(leaves[0])
        if axes is not None and axes - {axis_name}:
            raise ValueError(
                f"{what}: a payload leaf varies over mesh axes {sorted(axes)}, and a data "
                f"shard's encoding is another algorithm's; send whole leaves, varying over "
                f"{axis_name!r} only (no shard_outer_state / fsdp)"
            )


def _flat_encode(payload: Payload) -> Encoded:
    """Per group one array: its leaves flattened into a vector of their common dtype, or a
    group of one leaf of two or more axes as it is (a reshape to one axis is a relayout of
    the whole array on TPU, where a chunk of rows, :mod:`co2jax.comm.chunks`, is sent)."""
    form, groups = Grouped.of(payload)
    data = tuple(
        g[0] if len(g) == 1 and g[0].ndim >= 2 else flatten(g, common_dtype(g))[0] for g in groups
    )
    return Encoded(data, _Flat(*form.fields()))


def _gather_packed(leaves: list, axis_name: str) -> list:
    """``leaves`` all-gathered as one buffer of words (one leaf: as it is)."""
    if len(leaves) == 1:
        return [jax.lax.all_gather(leaves[0], axis_name)]
    words = pack_rows([x[None] for x in leaves])[0]
    return unpack_rows(jax.lax.all_gather(words, axis_name), leaves)


def all_gather_tree(tree: Any, axis_name: str, packed: bool = True) -> Any:
    """Every leaf of ``tree`` all-gathered over ``axis_name`` (a leading ``[R]`` axis).

    ``packed``: several leaves travel as one byte buffer in one collective (bit cast, so
    exactly the same values). XLA:TPU keeps one asynchronous collective in flight under an
    inner step: an encoding's second array (int8 values and their scales, top-k values and
    indices) gathered on its own was synchronous (25M parameters, int8: 3% of the bytes in
    flight; ``docs/overlap.md``). ``packed=False`` gathers leaf by leaf (the twin the tests
    compare with).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> tree = {"q": jnp.array([[1, -2]], jnp.int8), "s": jnp.array([[0.5]])}
      >>> out = jax.vmap(lambda t: all_gather_tree(t, "r"), axis_name="r")(tree)
      >>> out["q"].shape, out["s"][0, 0, 0].item()
      ((1, 1, 2), 0.5)
    """
    if not packed or len(jax.tree.leaves(tree)) < 2:
        return jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name), tree)
    # leaves that vary over different mesh axes (inside shard_map) are packed apart: packed
    # together, a leaf would take on the other's axes
    return by_varying_axes(tree, lambda group: _gather_packed(group, axis_name))


def gather_reduce(encode: Callable[[Payload], Encoded], axis_name: str) -> Callable:
    """The in-program reduce of a gather form: all-gather the encoding (its arrays in one
    collective, :func:`all_gather_tree`), combine it."""

    def reduce(payload: Payload) -> Any:
        axis_size(axis_name)
        if not jax.tree.leaves(payload):
            return payload
        encoded = payload if isinstance(payload, Encoded) else encode(payload)
        return all_gather_tree(encoded, axis_name).combine()

    return reduce


def ring_bytes(payload_bytes: float, replicas: int) -> float:
    """Bytes one replica sends in a ring all-reduce of ``payload_bytes``: 2 (R-1)/R of them."""
    return 2.0 * (replicas - 1) / replicas * payload_bytes if replicas > 1 else 0.0


def gather_bytes(payload_bytes: float, replicas: int) -> float:
    """Bytes one replica sends in an all-gather of ``payload_bytes`` (to the R-1 others)."""
    return float(payload_bytes) * (replicas - 1) if replicas > 1 else 0.0


def pmean(axis_name: str = REPLICA) -> Reducer:
    """The all-reduce mean, ``lax.pmean``, in the payload's own dtypes.

    Outside a bound ``axis_name`` it raises a ``NameError`` that says how to run it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jax.vmap(pmean("replica"), axis_name="replica")(jnp.array([1.0, 3.0]))
      Array([2., 2.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def reduce(payload: Payload) -> Payload:
        axis_size(axis_name)
        return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), payload)

    wire = lambda shapes, r: ring_bytes(tree_bytes(shapes), r)
    return Reducer("pmean", reduce, wire, _flat_encode, exact=True, splittable=True)


def all_gather_mean(axis_name: str = REPLICA) -> Reducer:
    """All-gather every replica's payload as one flat buffer (per group of leaves, in their
    common dtype), then average locally in float32.

    One collective for the payload: XLA:TPU keeps one asynchronous collective in flight
    across a loop, so a collective per leaf would leave all but one synchronous.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jax.vmap(all_gather_mean("replica"), axis_name="replica")(jnp.array([1.0, 2.0, 6.0]))
      Array([3., 3., 3.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)
    wire = lambda shapes, r: gather_bytes(
        tree_size(shapes) * jnp.dtype(common_dtype(jax.tree.leaves(shapes))).itemsize, r
    )
    return Reducer(
        "all_gather",
        gather_reduce(_flat_encode, axis_name),
        wire,
        _flat_encode,
        exact=True,
        splittable=True,
    )


def ring_mean(axis_name: str = REPLICA) -> Reducer:
    """A ppermute ring: reduce-scatter then all-gather of the flattened payload (per group of
    leaves), in float32.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(12.0).reshape(4, 3)  # 4 replicas, 3 elements each
      >>> jax.vmap(ring_mean("replica"), axis_name="replica")(x)[0]
      Array([4.5, 5.5, 6.5], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def ring(flat: jax.Array, r: int) -> jax.Array:
        n = flat.size
        chunks = jnp.pad(flat, (0, (-n) % r)).reshape(r, -1)
        i = jax.lax.axis_index(axis_name)
        perm = [(j, (j + 1) % r) for j in range(r)]
        # reduce-scatter: after step s, this replica holds chunk (i - 1 - s) summed over s + 2
        # replicas; after r - 1 steps it holds the full sum of chunk (i + 1) mod r.
        acc = chunks[i]
        for s in range(r - 1):
            acc = jax.lax.ppermute(acc, axis_name, perm) + chunks[(i - 1 - s) % r]
        out = jnp.zeros_like(chunks).at[(i + 1) % r].set(acc)
        # all-gather: at step s, receive the reduced chunk (i - s) mod r from the left.
        for s in range(r - 1):
            acc = jax.lax.ppermute(acc, axis_name, perm)
            out = out.at[(i - s) % r].set(acc)
        return out.reshape(-1)[:n] / r

    def reduce(payload: Payload) -> Payload:
        r = axis_size(axis_name)
        if r == 1 or not jax.tree.leaves(payload):
            return payload
        form, groups = Grouped.of(payload)
        return form.assemble([ring(flatten(g)[0], r) for g in groups])

    wire = lambda shapes, r: ring_bytes(4 * tree_size(shapes), r)  # sent as float32
    return Reducer("ring", reduce, wire, _flat_encode, exact=True, splittable=True)


def scatter_gather_mean(axis_name: str = REPLICA) -> Reducer:
    """Reduce-scatter by an all-to-all, then all-gather: the ring's bytes, 2 (R-1)/R of the
    payload, in two collectives instead of the ring's 2 (R-1) dependent steps.

    Each group of leaves (one leaf keeps its shape; several are flattened in their common
    dtype) is cut along its leading axis into R pieces; the all-to-all hands replica i the
    R replicas' piece i, which it averages in float32 (replica order) and casts back; the
    all-gather returns every averaged piece to every replica. At R = 2 an all-gather of the
    payload sends the same bytes in one collective; above, it sends (R-1) of the payload,
    up to R/2 times the ring's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(12.0).reshape(4, 3)  # 4 replicas, 3 elements each
      >>> jax.vmap(scatter_gather_mean("replica"), axis_name="replica")(x)[0]
      Array([4.5, 5.5, 6.5], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def mean(x: jax.Array, r: int) -> jax.Array:
        n = x.shape[0]
        pieces = jnp.pad(x, [(0, (-n) % r)] + [(0, 0)] * (x.ndim - 1))
        pieces = pieces.reshape(r, -1, *x.shape[1:])
        mine = jax.lax.all_to_all(pieces, axis_name, 0, 0)  # [R, n/R, ...]: piece i of each
        reduced = jnp.mean(mine.astype(jnp.float32), axis=0).astype(x.dtype)
        return jax.lax.all_gather(reduced, axis_name, tiled=True)[:n]

    def reduce(payload: Payload) -> Payload:
        r = axis_size(axis_name)
        if r == 1 or not jax.tree.leaves(payload):
            return payload
        form, groups = Grouped.of(payload)
        out = []
        for g in groups:
            if len(g) == 1 and g[0].ndim >= 1:
                out.append(mean(g[0], r))
            else:
                out.append(mean(flatten(g, common_dtype(g))[0], r))
        return form.assemble(out)

    wire = lambda shapes, r: ring_bytes(
        tree_size(shapes) * jnp.dtype(common_dtype(jax.tree.leaves(shapes))).itemsize, r
    )
    return Reducer("scatter_gather", reduce, wire, _flat_encode, exact=True, splittable=True)


@dataclasses.dataclass(frozen=True)
class _Stacked(Grouped):
    """Each group packed in the fused update's layout; combined into :class:`Gathered`."""

    layouts: tuple = ()
    quantized: bool = False

    def combine(self, data, weights=None):
        if weights is not None:  # each replica's values, weighted: no fused average
            one = lambda r: self.combine(jax.tree.map(lambda x: x[r : r + 1], data)).mean()
            stacked = [one(r) for r in range(weights.shape[0])]
            return jax.tree.map(
                lambda *xs: weighted_mean(jnp.stack(xs).astype(jnp.float32), weights).astype(
                    xs[0].dtype
                ),
                *stacked,
            )
        parts = []
        for group, layout, arrays in zip(self.groups, self.layouts, data, strict=True):
            buffer, scales = arrays if self.quantized else (arrays, None)
            parts.append(Part(buffer, layout, scales, group))
        return Gathered.of_parts(parts, self.treedef)


def all_gather_stacked(
    axis_name: str = REPLICA,
    block_sizes=None,
    quantize: str | None = None,
    implementation: str = "auto",
) -> Reducer:
    """All-gather every replica's payload, left un-reduced for a fused outer update.

    The payload is packed in the fused kernel's bucket layout (:mod:`co2jax.kernels.layout`)
    in its own dtype (float32 when the leaves' dtypes differ), gathered, and returned as
    :class:`co2jax.kernels.Gathered`: an ``apply`` that accepts it averages the R payloads
    inside its update pass instead of in a fusion of their own.

    With ``quantize="int8"`` each 128-lane row of the packed payload is quantized to int8
    with a float32 scale (:func:`co2jax.kernels.quantize.quantize_int8`, run as
    ``implementation`` says) and the codes and scales are gathered: the fused update
    dequantizes, averages and steps in one pass. ``wire_bytes`` counts the padded layout.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_gather_stacked("replica")
      >>> jax.vmap(lambda x: reduce(x).mean(), axis_name="replica")(jnp.array([1.0, 2.0, 6.0]))
      Array([3., 3., 3.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got quantize={quantize!r}")

    def encode(payload: Payload) -> Encoded:
        form, groups = Grouped.of(payload)
        layouts, data = [], []
        for leaves in groups:
            layout = gather_layout(leaves, block_sizes)
            layouts.append(layout)
            if quantize is None:
                data.append(layout.pack(leaves, common_dtype(leaves)))
            else:
                packed = layout.pack(leaves, jnp.float32)
                data.append(qk.quantize_int8(packed, implementation=implementation))
        stacked = _Stacked(*form.fields(), tuple(layouts), quantize is not None)
        return Encoded(tuple(data), stacked)

    def wire(shapes, replicas: int) -> float:
        layout = gather_layout(shapes, block_sizes)
        if quantize is None:
            row = LANES * jnp.dtype(common_dtype(jax.tree.leaves(shapes))).itemsize
        else:
            row = LANES + 4  # int8 codes and a float32 scale
        return gather_bytes(layout.total_rows * row, replicas)

    name = "all_gather_stacked" + ("(int8)" if quantize else "")
    return Reducer(
        name,
        gather_reduce(encode, axis_name),
        wire,
        encode,
        gathered=True,
        exact=quantize is None,
    )


def as_reducer(reduce: Any, axis_name: str = REPLICA) -> Reducer:
    """``reduce`` as a :class:`Reducer`: ``None`` is :func:`pmean`; a plain callable
    ``payload -> reduced`` is wrapped (its bytes counted as a ring all-reduce's)."""
    if reduce is None:
        return pmean(axis_name)
    if isinstance(reduce, Reducer):
        return reduce
    if not callable(reduce):
        raise ValueError(f"reduce must be a co2jax.comm.Reducer or a callable, got {reduce!r}")
    return Reducer("custom", reduce, lambda shapes, r: ring_bytes(tree_bytes(shapes), r))
