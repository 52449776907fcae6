"""Compressed collectives: only encoded bytes cross the replica axis, means are in float32.

- :func:`all_gather_compressed`: every replica's encoded payload all-gathered; each replica
  decodes the R payloads and averages them. Equal to the mean of the replicas' roundtrips.
- :func:`all_reduce_compressed`: a reduce-scatter then an all-gather, both of encoded shards
  of whole codec blocks (about half the all-gather's bytes at 4 replicas; the mean is
  quantized once more, in the same blocks).
- :func:`all_gather_topk`: every replica's top-k per chunk (indices and values) gathered and
  averaged per index, over the replicas that selected it (SparseLoCo).

Each packs the leaves of one :func:`co2jax.tree.varying_groups` group into one vector, so
inside ``shard_map`` a data shard never shares a quantization block with a whole leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_choice
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.codecs import Codec, support, topk
from co2jax.comm.reducer import (
    Encoded,
    Grouped,
    Payload,
    Reducer,
    all_gather_tree,
    gather_bytes,
    gather_reduce,
    per_contributor,
)
from co2jax.comm.staged import Stages, exchange_tree
from co2jax.tree import flatten, tree_size


@dataclasses.dataclass(frozen=True)
class _Coded(Grouped):
    """Each group as one ``codec`` encoding; combined by decoding and a float32 mean."""

    codec: Codec | None = None

    @property
    def per_unit(self) -> int:
        return self.codec.block or 1

    def mean(self, data, sizes, weights=None):
        return [self.codec.mean_of(enc, n, weights) for enc, n in zip(data, sizes, strict=True)]


@dataclasses.dataclass(frozen=True)
class _Sparse(_Coded):
    """Top-k encodings; combined by a mean over the replicas that selected each index."""

    chunk: int = 1
    per_index = True

    def mean(self, data, sizes, weights=None):
        vectors = []
        for enc, n in zip(data, sizes, strict=True):
            total = jnp.zeros((n,), jnp.float32)
            count = jnp.zeros((n,), jnp.float32)
            for r in range(jax.tree.leaves(enc)[0].shape[0]):
                one = jax.tree.map(lambda e, r=r: e[r], enc)
                w = 1.0 if weights is None else weights[r].astype(jnp.float32)
                total = total + w * self.codec.decode(one, n)
                count = count + w * support(one, self.chunk, n)
            vectors.append(per_contributor(total, count))
        return vectors


def _gathered(name: str, codec: Codec, axis_name: str, form_type, **extra) -> Reducer:
    """An all-gather of each group's ``codec`` encoding, combined by ``form_type``."""
    check_axis_name("axis_name", axis_name)

    def encode(payload: Payload) -> Encoded:
        form, groups = Grouped.of(payload)
        data = tuple(codec.encode(flatten(g)[0]) for g in groups)
        return Encoded(data, form_type(*form.fields(), codec, **extra))

    wire = lambda shapes, r: gather_bytes(codec.wire_bytes(tree_size(shapes)), r)
    # a codec encodes each of its blocks on its own: any whole blocks reduce alone
    return Reducer(
        name, gather_reduce(encode, axis_name), wire, encode, codec=codec, splittable=True
    )


def all_gather_compressed(codec: Codec, axis_name: str = REPLICA) -> Reducer:
    """A reducer that sends ``codec``-encoded payloads and averages them in float32.

    Each replica encodes its flattened payload; the encoded arrays (values, scales, indices)
    are all-gathered over ``axis_name``; every replica decodes the R payloads and takes
    their float32 mean. The result equals the mean of the replicas' ``roundtrip`` payloads.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from co2jax.comm import two_bit
      >>> reduce = all_gather_compressed(two_bit(block=4))
      >>> jax.jit(jax.vmap(reduce, axis_name="replica"))(jnp.array([[1.0, 0.2], [-3.0, 3.0]]))
      Array([[-1. ,  1.5],
             [-1. ,  1.5]], dtype=float32)
    """
    return _gathered(f"all_gather_compressed({codec.name})", codec, axis_name, _Coded)


def shard_size(n: int, replicas: int, unit: int = 1) -> int:
    """Elements in each of the R shards of :func:`all_reduce_compressed` for an n-element
    vector: ``unit * ceil(ceil(n / unit) / R)``, whole ``unit`` s (the codec's blocks).

    A shard encodes into ``ceil(n / (unit R))`` blocks, as many as a shard of ``ceil(n / R)``
    elements padded to whole blocks does: whole-block shards cost no extra byte.

    Example:
      >>> shard_size(200, 8, 128), shard_size(1000, 4, 128), shard_size(10, 4)
      (128, 256, 3)
    """
    blocks = -(-n // unit)
    return unit * -(-blocks // replicas)


def all_reduce_compressed(codec: Codec, axis_name: str = REPLICA) -> Reducer:
    """A compressed all-reduce in two steps (reduce-scatter, then all-gather), each sending
    ``codec``-encoded data.

    Each group's flattened payload (n elements) is cut into R shards of whole codec blocks,
    ``m = B ceil(ceil(n / B) / R)`` elements (:func:`shard_size`; ``B`` = ``codec.block``,
    1 for a codec without blocks; the last shards zero-padded). Each replica encodes its R
    shards and sends shard i to replica i (the reduce-scatter: R - 1 ``ppermute`` s of an
    encoded shard, its arrays packed in one buffer, :func:`co2jax.comm.staged.exchange_tree`);
    replica i decodes the R copies of its shard and averages them in float32, encodes that
    mean and all-gathers it; every replica decodes the R mean shards. The two stages are the
    reducer's ``stages``: a round that spreads a transfer over its steps scatters piece k at
    step k and gathers its encoded mean at step k + 1, both in flight under the steps'
    compute on TPU (:mod:`co2jax.comm.staged`; ``docs/overlap.md``).

    .. math::

        \\bar x_b = D\\Big(C\\Big(\\frac1R \\sum_r D(C(x_{r,b}))\\Big)\\Big)
        \\quad \\text{for every block } b \\text{ of the vector}

    A shard starts on a block boundary, so both quantizations use the blocks of the whole
    vector (element 0 on): the reduction is block by block. ``roundtrip(payload)`` is what a
    replica transmits, ``D(C(x))`` per block: error feedback sends it and keeps the rest, and
    the collective re-encodes it to the same codes (a block codec is idempotent), so the
    mean's first quantization is of exactly what error feedback encoded. Cut into chunks of
    whole blocks (a spread transfer), each chunk reduces to the whole reduction's values.

    A replica sends ``2 (R-1)`` encoded shards, ``~2 (R-1)/R`` times the encoded payload: what
    a ring all-reduce sends uncompressed, against ``R-1`` times for
    :func:`all_gather_compressed`. The price is the second quantization (of the mean), which
    error feedback on the replicas does not see. It has no gather form (``encode`` is None):
    separate jobs cannot run it. Every replica ends with the same values.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from co2jax.comm import int8
      >>> reduce = all_reduce_compressed(int8(block=2))
      >>> jax.jit(jax.vmap(reduce, axis_name="replica"))(jnp.array([[1.0, 0.5], [3.0, -0.5]]))
      Array([[2., 0.],
             [2., 0.]], dtype=float32)
      >>> from co2jax.comm import two_bit  # what one replica transmits: blocks of 4, any R
      >>> all_reduce_compressed(two_bit(block=4)).roundtrip(jnp.array([4.0, 1, -3, 2, -1, 0.5]))
      Array([ 4.,  0., -4.,  4., -1.,  1.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)
    unit = codec.block or 1

    def scatter_one(v: jax.Array) -> Any:
        r, n = axis_size(axis_name), v.shape[0]
        m = shard_size(n, r, unit)
        shards = jnp.pad(v, (0, r * m - n)).reshape(r, m)
        encoded = jax.vmap(codec.encode)(shards)  # leading axis: the destination replica
        mine = exchange_tree(encoded, axis_name)  # leading axis: the source
        return codec.encode(codec.mean_of(mine, m))

    def gather_one(share: Any, n: int) -> jax.Array:
        m = shard_size(n, axis_size(axis_name), unit)
        gathered = all_gather_tree(share, axis_name)
        return jax.vmap(lambda e: codec.decode(e, m))(gathered).reshape(-1)[:n]

    def scatter(vectors: list[jax.Array]) -> list[Any]:
        return [scatter_one(v) for v in vectors]

    def gather(shares: list[Any], rows: list[int]) -> list[jax.Array]:
        return [gather_one(s, n) for s, n in zip(shares, rows, strict=True)]

    def empty(n: int, r: int, piece) -> Any:
        vector = jax.ShapeDtypeStruct((shard_size(n, r, unit),), jnp.float32)
        return jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(codec.encode, vector)
        )

    def reduce(payload: Payload) -> Payload:
        axis_size(axis_name)
        if not jax.tree.leaves(payload):
            return payload
        form, groups = Grouped.of(payload)
        vectors = [flatten(g)[0] for g in groups]
        return form.assemble(gather(scatter(vectors), [v.shape[0] for v in vectors]))

    def roundtrip(payload: Payload) -> Payload:
        # the shards are whole blocks of each group's vector: encoding the vector encodes
        # every shard's blocks, and needs no replica count
        form, groups = Grouped.of(payload)
        return form.assemble([codec.roundtrip(flatten(g)[0]) for g in groups])

    def wire(shapes, replicas: int) -> float:
        if replicas <= 1:
            return 0.0
        shard = codec.wire_bytes(shard_size(tree_size(shapes), replicas, unit))
        return 2.0 * (replicas - 1) * shard

    name = f"all_reduce_compressed({codec.name})"
    # block by block, both quantizations in the whole vector's blocks: any whole blocks
    # reduce alone (a chunk, a device's slice of one), and the stages may run apart
    stages = Stages(scatter, gather, empty)
    return Reducer(
        name, reduce, wire, codec=codec, roundtrip=roundtrip, splittable=True, stages=stages
    )


def all_gather_topk(
    k: int,
    chunk: int = 4096,
    values: Codec | None = None,
    mean: str = "contributors",
    axis_name: str = REPLICA,
) -> Reducer:
    """A sparse collective: every replica's top-``k`` per ``chunk`` (indices + ``values``
    codec) all-gathered, then averaged per index.

    ``mean="contributors"`` (SparseLoCo) divides each index's sum by the number of replicas
    that selected it (an index nobody selected stays 0). The count comes from the gathered
    indices themselves, so a selected value that the values codec rounds to zero still
    counts, and an index the replica did not select never does. ``mean="replicas"`` divides
    by R, which is :func:`all_gather_compressed` of the same :func:`~co2jax.comm.topk` codec.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_gather_topk(1, chunk=2)
      >>> jax.jit(jax.vmap(reduce, axis_name="replica"))(jnp.array([[4.0, 0.0], [2.0, 1.0]]))
      Array([[3., 0.],
             [3., 0.]], dtype=float32)
    """
    check_choice("mean", mean, ("contributors", "replicas"))
    codec = topk(k, chunk, values)
    if mean == "replicas":
        return all_gather_compressed(codec, axis_name)
    return _gathered(f"all_gather_topk({codec.name})", codec, axis_name, _Sparse, chunk=chunk)
