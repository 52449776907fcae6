"""Compressed pseudo-gradients: codecs, a compressed collective and error feedback.

A :class:`Codec` turns a float32 vector into what goes on the wire (values, per-block scales,
indices: a small pytree of arrays) and back. Every codec here works on blocks of ``block``
consecutive elements (the last one zero-padded), so it accepts any size:

==========  ===========================================  =====================================
name        on the wire, per block of B elements          decoded value
==========  ===========================================  =====================================
``none``    B float32                                     exact
``bf16``    B bfloat16                                    round to nearest bfloat16
``fp8``     B float8 e4m3 + 1 float32 scale               ``s * e4m3(x / s)``, ``s = max|x|/448``
``int8``    B int8 + 1 float32 scale                      ``s * round(x / s)``, ``s = max|x|/127``
``fp4``     B/2 bytes (E3M0 codes) + 1 float32 scale      ``s * 2**-k`` (k = 0..6) or 0, sign
``2bit``    B/4 bytes (ternary codes) + 1 float32 scale   ``s * {-1, 0, 1}``, ``s = max|x|``
``topk``    k (index, value) pairs, values by an inner    the k largest-magnitude elements of
            codec                                         each chunk, zero elsewhere
==========  ===========================================  =====================================

FP4 E3M0 (1 sign bit, 3 exponent bits, no mantissa, as in Streaming DiLoCo): code 0 is zero,
codes 1..7 are ``s * 2**(code - 7)``; a magnitude rounds to the nearest of those (in the
linear domain), so the error is at most a third of the value, or half the smallest level.
The 2-bit format is ternary (one code unused) so that zeros stay exact; its error is at most
``s / 2``. Zeros are exact in every format; a block of zeros has scale 0 and decodes to zeros.

Non-finite input is not clipped or hidden: a NaN or Inf in a block makes that block's scale
non-finite and the whole block decodes to NaN, so :func:`co2jax.skip_nonfinite` still sees
it.

:func:`all_gather_compressed` is a reducer (``reduce=`` of any algorithm): each replica
encodes its flattened payload, the encoded pieces are all-gathered (the bytes on the wire are
the compressed bytes), and every replica decodes the R payloads and averages them in float32.
:func:`error_feedback` keeps the per-replica residual ``e <- (Delta + e) - D(C(Delta + e))``
and sends ``D(C(Delta + e))``; the codecs are idempotent (``C(D(C(x))) == C(x)``), so the
compressed collective transmits exactly the compressed value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from co2jax._base import (
    REPLICA_AXIS,
    OuterOptimizer,
    Params,
    Reducer,
    check_axis,
    check_axis_name,
    check_int,
    make_outer_optimizer,
)

FORMATS = ("none", "bf16", "fp8", "int8", "fp4", "2bit", "topk")
_E4M3_MAX = 448.0


class Codec(NamedTuple):
    """A compression format on 1-D float32 vectors.

    Attributes:
      name: the format's name.
      encode: ``encode(x) -> encoded`` for a 1-D float32 ``x`` (a pytree of arrays).
      decode: ``decode(encoded, n) -> x_hat``, the float32 vector of length n.
      wire_bytes: ``wire_bytes(n) -> int``: the encoded size of n elements (values, scales,
        indices), what a replica puts on the wire.
      decode_mean: optional ``decode_mean(gathered, n)``: the float32 mean of R encoded
        payloads stacked on a leading axis, in one pass (a fused kernel); ``None`` decodes
        them one by one.
      block: elements per scale block, for the formats that have one.
    """

    name: str
    encode: Callable[[jax.Array], Any]
    decode: Callable[[Any, int], jax.Array]
    wire_bytes: Callable[[int], int]
    decode_mean: Callable[[Any, int], jax.Array] | None = None
    block: int | None = None

    def roundtrip(self, x: jax.Array) -> jax.Array:
        """``decode(encode(x))`` for a vector."""
        return self.decode(self.encode(x), x.shape[0])


def _blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[0]
    return jnp.pad(x.astype(jnp.float32), (0, (-n) % block)).reshape(-1, block)


def _nblocks(n: int, block: int) -> int:
    return -(-n // block)


def _absmax_scale(xb: jax.Array, top: float) -> jax.Array:
    """Per-block scale ``max|x| / top`` (0 for an all-zero block; NaN/Inf propagate)."""
    return jnp.max(jnp.abs(xb), axis=1) / top


def _safe(scale: jax.Array) -> jax.Array:
    return jnp.where(scale > 0, scale, 1.0)[:, None]


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes ``[blocks, B]`` (each < 2**bits) packed ``8 // bits`` per byte by planes:
    byte j of a block holds codes j, j + B/per, j + 2B/per, ... (lowest bits first), so a
    block of 128 packs its lane halves (or quarters) together, as the Pallas kernels of
    :mod:`co2jax.kernels.quantize` do."""
    per = 8 // bits
    blocks, width = codes.shape
    planes = codes.reshape(blocks, per, width // per).astype(jnp.uint8)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[None, :, None]
    return jnp.sum(planes << shifts, axis=1, dtype=jnp.uint8)


def _unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`_pack`: ``[blocks, B / per]`` bytes -> ``[blocks, B]`` codes."""
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[None, :, None]
    planes = (packed[:, None, :] >> shifts) & ((1 << bits) - 1)
    return planes.reshape(packed.shape[0], -1)


def _check_block(block: int, multiple: int = 1) -> int:
    block = check_int("block", block, 1)
    if block % multiple:
        raise ValueError(f"block must be a multiple of {multiple}, got block={block!r}")
    return block


def none() -> Codec:
    """Uncompressed float32."""
    return Codec("none", lambda x: x.astype(jnp.float32), lambda e, n: e[:n], lambda n: 4 * n)


def bf16() -> Codec:
    """Round to bfloat16 (no scale)."""
    return Codec(
        "bf16",
        lambda x: x.astype(jnp.bfloat16),
        lambda e, n: e[:n].astype(jnp.float32),
        lambda n: 2 * n,
    )


def fp8(block: int = 128) -> Codec:
    """float8 e4m3 with a float32 scale per ``block`` elements (``max|x|`` maps to 448)."""
    block = _check_block(block)

    def encode(x):
        xb = _blocks(x, block)
        scale = _absmax_scale(xb, _E4M3_MAX)
        return (xb / _safe(scale)).astype(jnp.float8_e4m3fn), scale

    def decode(enc, n):
        q, scale = enc
        return (q.astype(jnp.float32) * scale[:, None]).reshape(-1)[:n]

    return Codec("fp8", encode, decode, lambda n: _nblocks(n, block) * (block + 4))


def int8(block: int = 128, implementation: str = "auto") -> Codec:
    """Symmetric int8 with a float32 scale per ``block`` elements (``max|x|`` maps to 127).

    With ``block=128`` encoding (:func:`co2jax.kernels.quantize.quantize_int8`) and the
    compressed collective's decode-and-average of the R gathered payloads
    (:func:`co2jax.kernels.quantize.dequantize_mean_int8`) run the Pallas kernels as
    ``implementation`` says (``"auto"``: the kernels on TPU, XLA elsewhere).
    """
    block = _check_block(block)

    def encode(x):
        xb = _blocks(x, block)
        if _uses_kernel(block, implementation):
            from co2jax.kernels.quantize import quantize_int8

            return quantize_int8(xb, implementation=implementation)
        scale = _absmax_scale(xb, 127.0)
        return jnp.round(xb / _safe(scale)).astype(jnp.int8), scale

    def decode(enc, n):
        q, scale = enc
        return (q.astype(jnp.float32) * scale[:, None]).reshape(-1)[:n]

    decode_mean = None
    if block == 128:

        def decode_mean(gathered, n):
            from co2jax.kernels.quantize import dequantize_mean_int8

            q, scale = gathered
            mean = dequantize_mean_int8(q, scale, implementation=implementation)
            return mean.reshape(-1)[:n]

    wire = lambda n: _nblocks(n, block) * (block + 4)
    return Codec("int8", encode, decode, wire, decode_mean, block)


def _signed_codes(xb, scale, magnitude_code):
    """4-bit codes: the top bit is the sign, the low bits the magnitude code."""
    code = magnitude_code(jnp.abs(xb) / _safe(scale))
    return jnp.where(xb < 0, code | 8, code).astype(jnp.uint8)


def _uses_kernel(block: int, implementation: str) -> bool:
    """Whether a ``block=128`` codec runs its Pallas kernels (``implementation`` resolved
    as in :mod:`co2jax.kernels.quantize`: ``"auto"`` is the kernel on TPU only)."""
    from co2jax.kernels.quantize import _resolve

    return block == 128 and _resolve(implementation)[0] != "xla"


def _packed_kernels(fmt: str, block: int, implementation: str, encode):
    """The encode and decode_mean of a packed format, through the kernels when they apply
    (``decode_mean`` is ``None`` unless ``block == 128``: then R payloads decode one by one)."""

    def kernel_encode(x):
        from co2jax.kernels.quantize import quantize_packed

        if not _uses_kernel(block, implementation):
            return encode(x)
        return quantize_packed(_blocks(x, block), fmt, implementation=implementation)

    def decode_mean(gathered, n):
        from co2jax.kernels.quantize import dequantize_mean_packed

        packed, scale = gathered
        mean = dequantize_mean_packed(packed, scale, fmt, implementation=implementation)
        return mean.reshape(-1)[:n]

    return kernel_encode, (decode_mean if block == 128 else None)


def fp4(block: int = 128, implementation: str = "auto") -> Codec:
    """FP4 E3M0: sign and a power of two ``s * 2**-k`` (k = 0..6) or zero, ``s = max|x|``.

    With ``block=128`` encoding and the collective's decode-and-average run the Pallas
    kernels of :mod:`co2jax.kernels.quantize` as ``implementation`` says (``"auto"``: on TPU).
    """
    block = _check_block(block, 2)
    levels = 2.0 ** np.arange(-6, 1)  # code c in 1..7 is 2**(c - 7)

    def magnitude_code(r):
        # nearest level in the linear domain; below half the smallest level, zero
        mids = np.concatenate([[levels[0] / 2], (levels[:-1] + levels[1:]) / 2])
        return jnp.sum(r[..., None] >= jnp.asarray(mids, jnp.float32), axis=-1).astype(jnp.uint8)

    def encode(x):
        xb = _blocks(x, block)
        scale = jnp.max(jnp.abs(xb), axis=1)
        codes = _signed_codes(xb, scale, magnitude_code)
        return _pack(codes, 4), scale

    def decode(enc, n):
        packed, scale = enc
        codes = _unpack(packed, 4)
        c = codes & 7
        mag = jnp.where(c > 0, 2.0 ** (c.astype(jnp.float32) - 7.0), 0.0)
        value = jnp.where(codes >= 8, -mag, mag) * scale[:, None]
        return value.reshape(-1)[:n]

    encode, decode_mean = _packed_kernels("fp4", block, implementation, encode)
    wire = lambda n: _nblocks(n, block) * (block // 2 + 4)
    return Codec("fp4", encode, decode, wire, decode_mean)


def two_bit(block: int = 128, implementation: str = "auto") -> Codec:
    """Ternary in 2 bits: ``s * {-1, 0, 1}`` with ``s = max|x|`` per block (``block=128``:
    the Pallas kernels, as for :func:`fp4`)."""
    block = _check_block(block, 4)

    def encode(x):
        xb = _blocks(x, block)
        scale = jnp.max(jnp.abs(xb), axis=1)
        r = xb / _safe(scale)
        codes = jnp.where(r >= 0.5, 1, jnp.where(r <= -0.5, 2, 0)).astype(jnp.uint8)
        return _pack(codes, 2), scale

    def decode(enc, n):
        packed, scale = enc
        codes = _unpack(packed, 2)
        value = jnp.where(codes == 1, 1.0, jnp.where(codes == 2, -1.0, 0.0))
        return (value * scale[:, None]).reshape(-1)[:n]

    encode, decode_mean = _packed_kernels("2bit", block, implementation, encode)
    wire = lambda n: _nblocks(n, block) * (block // 4 + 4)
    return Codec("2bit", encode, decode, wire, decode_mean)


def topk(k: int, chunk: int = 4096, values: Codec | None = None) -> Codec:
    """The ``k`` largest-magnitude elements of every ``chunk`` (indices + values).

    Indices are uint16 within the chunk (``chunk <= 65536``); the k values per chunk are
    encoded by ``values`` (default float32; SparseLoCo uses :func:`two_bit` with
    ``block=k``). Elements not selected decode to zero.
    """
    chunk = check_int("chunk", chunk, 1)
    k = check_int("k", k, 1)
    if k > chunk or chunk > 65536:
        raise ValueError(f"need 1 <= k <= chunk <= 65536, got k={k!r}, chunk={chunk!r}")
    values = none() if values is None else values

    def encode(x):
        xc = _blocks(x, chunk)
        _, idx = jax.lax.top_k(jnp.abs(xc), k)
        picked = jnp.take_along_axis(xc, idx, axis=1)
        return idx.astype(jnp.uint16), values.encode(picked.reshape(-1))

    def decode(enc, n):
        idx, vals = enc
        chunks = idx.shape[0]
        picked = values.decode(vals, chunks * k).reshape(chunks, k)
        out = jnp.zeros((chunks, chunk), jnp.float32)
        out = out.at[jnp.arange(chunks)[:, None], idx.astype(jnp.int32)].set(picked)
        return out.reshape(-1)[:n]

    def wire_bytes(n):
        chunks = _nblocks(n, chunk)
        return chunks * k * 2 + values.wire_bytes(chunks * k)

    return Codec(f"topk{k}/{chunk}+{values.name}", encode, decode, wire_bytes)


def make(name: str, **options) -> Codec:
    """The codec named ``name`` (one of ``FORMATS``) with its options."""
    makers = {
        "none": none,
        "bf16": bf16,
        "fp8": fp8,
        "int8": int8,
        "fp4": fp4,
        "2bit": two_bit,
        "topk": topk,
    }
    if name not in makers:
        raise ValueError(f"compression must be one of {FORMATS}, got compression={name!r}")
    return makers[name](**options)


# ---------------------------------------------------------------------------------------------
# pytrees


def flatten(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """One float32 vector of every leaf, and the function that splits it back (dtypes kept)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.float32), lambda v: tree
    flat = jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])

    def unflatten(vector: jax.Array) -> Any:
        pieces, offset = [], 0
        for x in leaves:
            pieces.append(vector[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
            offset += x.size
        return jax.tree.unflatten(treedef, pieces)

    return flat, unflatten


def by_varying_axes(tree: Any, fn: Callable[[list[jax.Array]], list[jax.Array]]) -> Any:
    """Applies ``fn`` to each group of leaves that vary over the same mesh axes.

    Inside ``shard_map`` a data shard of one leaf may sit next to a whole leaf (the round
    engine's ``shard_outer_state``); encoding them in shared quantization blocks would make
    the whole leaf's result depend on the shard. Outside ``shard_map`` there is one group.
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        kind = getattr(jax.typeof(x), "manual_axis_type", None)
        groups.setdefault(None if kind is None else kind.varying, []).append(i)
    out: list[Any] = [None] * len(leaves)
    for members in groups.values():
        for i, y in zip(members, fn([leaves[i] for i in members]), strict=True):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def roundtrip_tree(codec: Codec, tree: Any) -> Any:
    """``decode(encode(tree))``, leaf dtypes kept, one flat vector per group of
    :func:`by_varying_axes`."""

    def group(leaves):
        flat, unflatten = flatten(leaves)
        return unflatten(codec.roundtrip(flat))

    return by_varying_axes(tree, group)


def tree_wire_bytes(codec: Codec, tree: Any) -> int:
    """Bytes one replica sends for ``tree`` (arrays or ShapeDtypeStructs)."""
    return codec.wire_bytes(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


# ---------------------------------------------------------------------------------------------
# the compressed collective and error feedback


def _grouped(
    reduce_group: Callable[[list[jax.Array], int], list[jax.Array]],
    codec: Codec,
    axis_name: str,
    wire_bytes: Callable[[int, int], float],
):
    """A reducer running ``reduce_group(leaves, R)`` per :func:`by_varying_axes` group, with
    ``reduce.codec`` and ``reduce.wire_bytes(n, R)`` (bytes one replica sends to reduce n
    elements over R replicas) set for byte accounting."""

    def reduce(payload: Any) -> Any:
        r = check_axis(axis_name)
        if not jax.tree.leaves(payload):
            return payload
        return by_varying_axes(payload, lambda leaves: reduce_group(leaves, r))

    reduce.codec = codec
    reduce.wire_bytes = wire_bytes
    return reduce


def _gather_bytes(codec: Codec) -> Callable[[int, int], float]:
    """Bytes of an all-gather of the encoded payload (:func:`co2jax.reducers.wire_bytes`)."""
    from co2jax.reducers import wire_bytes

    return lambda n, r: wire_bytes("all_gather", codec.wire_bytes(n), r)


def all_gather_compressed(codec: Codec, axis_name: str = REPLICA_AXIS) -> Reducer:
    """A reducer that sends ``codec``-encoded payloads and averages them in float32.

    Each replica encodes its flattened payload; the encoded arrays (values, scales, indices)
    are all-gathered over ``axis_name``; every replica decodes the R payloads and takes
    their float32 mean. The result equals the mean of the replicas' ``roundtrip`` payloads.
    ``reduce.codec`` is the codec, for byte accounting.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_gather_compressed(two_bit(block=4))
      >>> jax.vmap(reduce, axis_name="replica")(jnp.array([[1.0, 0.2], [-3.0, 3.0]]))
      Array([[-1. ,  1.5],
             [-1. ,  1.5]], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def reduce_group(leaves: list[jax.Array], r: int) -> list[jax.Array]:
        flat, unflatten = flatten(leaves)
        encoded = codec.encode(flat)
        gathered = jax.tree.map(lambda e: jax.lax.all_gather(e, axis_name), encoded)
        if codec.decode_mean is not None:
            return unflatten(codec.decode_mean(gathered, flat.size))
        total = jnp.zeros_like(flat)
        for i in range(r):
            total = total + codec.decode(jax.tree.map(lambda e, i=i: e[i], gathered), flat.size)
        return unflatten(total / r)

    reduce = _grouped(reduce_group, codec, axis_name, _gather_bytes(codec))
    if codec.name == "int8" and codec.block == 128:
        # the same format in the fused update's layout: a pseudo-gradient method whose update
        # runs the kernel dequantizes, averages and steps in one pass
        from co2jax.reducers import all_gather_stacked

        reduce.stacked = lambda implementation: all_gather_stacked(
            axis_name, quantize="int8", implementation=implementation
        )
    return reduce


def all_reduce_compressed(codec: Codec, axis_name: str = REPLICA_AXIS) -> Reducer:
    """A compressed all-reduce in two steps (reduce-scatter, then all-gather), each sending
    ``codec``-encoded data.

    The flattened payload is cut into R shards of ``m = ceil(n / R)`` elements. Each replica
    encodes its R shards and sends shard i to replica i (an all-to-all of encoded shards: the
    reduce-scatter); replica i decodes the R copies of its shard and averages them in
    float32, encodes that mean and all-gathers it; every replica decodes the R mean shards.

    .. math::

        \\bar x_i = D\\Big(C\\Big(\\frac1R \\sum_r D(C(x_{r,i}))\\Big)\\Big)

    A replica sends ``2 (R-1)`` encoded shards, ``~2 (R-1)/R`` times the encoded payload: what
    a ring all-reduce sends uncompressed, against ``R-1`` times for
    :func:`all_gather_compressed`. The price is the second quantization (of the mean), which
    error feedback on the replicas does not see. Every replica ends with the same values.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_reduce_compressed(int8(block=2))
      >>> jax.vmap(reduce, axis_name="replica")(jnp.array([[1.0, 0.5], [3.0, -0.5]]))
      Array([[2., 0.],
             [2., 0.]], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def reduce_group(leaves: list[jax.Array], r: int) -> list[jax.Array]:
        flat, unflatten = flatten(leaves)
        n = flat.size
        m = -(-n // r)
        shards = jnp.pad(flat, (0, r * m - n)).reshape(r, m)
        encoded = jax.vmap(codec.encode)(shards)  # leading axis: the destination replica
        mine = jax.lax.all_to_all(encoded, axis_name, 0, 0)  # leading axis: the source
        if codec.decode_mean is not None:
            mean = codec.decode_mean(mine, m)
        else:
            mean = jnp.mean(jax.vmap(lambda e: codec.decode(e, m))(mine), axis=0)
        gathered = jax.lax.all_gather(codec.encode(mean), axis_name)
        decoded = jax.vmap(lambda e: codec.decode(e, m))(gathered)
        return unflatten(decoded.reshape(-1)[:n])

    def wire_bytes(n: int, replicas: int) -> float:
        return 2.0 * (replicas - 1) * codec.wire_bytes(-(-n // replicas)) if replicas > 1 else 0.0

    return _grouped(reduce_group, codec, axis_name, wire_bytes)


def all_gather_topk(
    k: int,
    chunk: int = 4096,
    values: Codec | None = None,
    mean: str = "contributors",
    axis_name: str = REPLICA_AXIS,
) -> Reducer:
    """A sparse collective: every replica's top-``k`` per ``chunk`` (indices + ``values``
    codec) all-gathered, then averaged per index.

    ``mean="contributors"`` (SparseLoCo) divides each index's sum by the number of replicas
    that selected it (an index nobody selected stays 0); ``mean="replicas"`` divides by R,
    which is :func:`all_gather_compressed` of the same :func:`topk` codec.
    """
    if mean not in ("contributors", "replicas"):
        raise ValueError(f"mean must be 'contributors' or 'replicas', got mean={mean!r}")
    codec = topk(k, chunk, values)
    if mean == "replicas":
        return all_gather_compressed(codec, axis_name)
    check_axis_name("axis_name", axis_name)

    def reduce_group(leaves: list[jax.Array], r: int) -> list[jax.Array]:
        flat, unflatten = flatten(leaves)
        idx, vals = codec.encode(flat)
        gathered = jax.lax.all_gather((idx, vals), axis_name)
        total = jnp.zeros_like(flat)
        count = jnp.zeros_like(flat)
        rows = jnp.arange(idx.shape[0])[:, None]
        for i in range(r):
            enc = jax.tree.map(lambda e, i=i: e[i], gathered)
            total = total + codec.decode(enc, flat.size)
            support = jnp.zeros((idx.shape[0], chunk), jnp.float32)
            support = support.at[rows, enc[0].astype(jnp.int32)].set(1.0)
            count = count + support.reshape(-1)[: flat.size]
        return unflatten(total / jnp.maximum(count, 1.0))

    return _grouped(reduce_group, codec, axis_name, _gather_bytes(codec))


def _feedback(codec: Codec, decay: float, payload: Any, residual: Any) -> tuple[Any, Any]:
    """One error-feedback step: ``target = payload + decay * residual`` is compressed;
    returns what is sent, ``D(C(target))`` in the payload's dtypes, and the new residual
    ``target - D(C(target))`` (float32).

    Both the payload and the apply step of a wrapper call this on the same inputs; inside
    one jitted program XLA computes it once (common-subexpression elimination, checked in
    ``tests/test_compression.py``), so a round encodes the target once.
    """
    target = jax.tree.map(lambda x, e: x.astype(jnp.float32) + decay * e, payload, residual)
    sent = roundtrip_tree(codec, target)
    new_residual = jax.tree.map(lambda t, c: t - c.astype(jnp.float32), target, sent)
    return jax.tree.map(lambda c, x: c.astype(x.dtype), sent, payload), new_residual


class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
      inner_state: the wrapped algorithm's state.
      residual: what compression has left out so far, shaped like the payload (float32).
        Replica-varying.
    """

    inner_state: Any
    residual: Any

    @property
    def anchor(self) -> Any:
        """The wrapped state's anchor (so that :func:`co2jax.skip_nonfinite` can wrap this)."""
        return self.inner_state.anchor


def error_feedback(outer: OuterOptimizer, codec: Codec, decay: float = 1.0) -> OuterOptimizer:
    """Compress ``outer``'s payload with error feedback (residual kept per replica).

    .. math::

        c_r = \\operatorname{D}(\\operatorname{C}(\\Delta_r + \\beta e_r)), \\qquad
        e_r \\leftarrow \\Delta_r + \\beta e_r - c_r

    and ``c_r`` is what the replica sends (reduce with :func:`all_gather_compressed` of the
    same codec to put only the compressed bytes on the wire; the codecs are idempotent, so
    the collective transmits exactly ``c_r``). ``decay`` is ``beta`` (1 = classic error
    feedback; SparseLoCo uses 0.95). Works for synchronous payloads (DiLoCo); a delayed
    algorithm's payload is its stored pending value, which this wraps as well.
    """
    if not (0.0 <= float(decay) <= 1.0):
        raise ValueError(f"decay must be in [0, 1], got decay={decay!r}")

    def init(params: Params) -> ErrorFeedbackState:
        inner = outer.init(params)
        shapes = jax.eval_shape(outer.payload, params, inner)
        residual = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
        return ErrorFeedbackState(inner, residual)

    def payload(params, state):
        return _feedback(codec, decay, outer.payload(params, state.inner_state), state.residual)[0]

    def apply(params, state, reduced):
        payload = outer.payload(params, state.inner_state)
        _, residual = _feedback(codec, decay, payload, state.residual)
        new_params, inner = outer.apply(params, state.inner_state, reduced)
        return new_params, ErrorFeedbackState(inner, residual)

    return make_outer_optimizer(init, payload, apply, outer.reduce, outer.staleness)


class StreamingErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback_streaming`: the wrapped Streaming DiLoCo state and one
    residual per fragment (float32, replica-varying)."""

    inner_state: Any
    residuals: tuple[Any, ...]

    @property
    def anchor(self) -> Any:
        return self.inner_state.anchor


def error_feedback_streaming(outer: Any, codec: Codec, decay: float = 1.0) -> Any:
    """:func:`error_feedback` for :func:`co2jax.streaming_diloco`: one residual per fragment.

    Fragment p sends ``c = D(C(Delta_p + decay * e_p))`` and keeps ``e_p <- Delta_p + decay *
    e_p - c``. Reduce with :func:`all_gather_compressed` of the same codec (``reduce=`` of
    ``streaming_diloco``) so that only the compressed bytes cross the wire.
    """
    if not (0.0 <= float(decay) <= 1.0):
        raise ValueError(f"decay must be in [0, 1], got decay={decay!r}")
    count = outer.fragments.count

    def init(params):
        inner = outer.init(params)
        residuals = tuple(
            [jnp.zeros(x.shape, jnp.float32) for x in outer.payload(params, inner, p)]
            for p in range(count)
        )
        return StreamingErrorFeedbackState(inner, residuals)

    def payload(params, state, p):
        sent, _ = _feedback(
            codec, decay, outer.payload(params, state.inner_state, p), state.residuals[p]
        )
        return sent

    def apply(params, state, p, reduced):
        payload = outer.payload(params, state.inner_state, p)
        _, residual = _feedback(codec, decay, payload, state.residuals[p])
        new_params, inner = outer.apply(params, state.inner_state, p, reduced)
        residuals = (*state.residuals[:p], residual, *state.residuals[p + 1 :])
        return new_params, StreamingErrorFeedbackState(inner, residuals)

    return outer._replace(init=init, payload=payload, apply=apply)
