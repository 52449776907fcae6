"""Compression formats for pseudo-gradients: float32 vectors to what goes on the wire and back.

A :class:`Codec` works on blocks of ``block`` consecutive elements (the last one
zero-padded), so it accepts any size:

==========  ===========================================  =====================================
name        on the wire, per block of B elements          decoded value
==========  ===========================================  =====================================
``none``    B float32                                     exact
``bf16``    B bfloat16                                    round to nearest bfloat16
``fp8``     B float8 e4m3 + 1 float32 scale               ``s * e4m3(x / s)``, ``s = max|x|/448``
``int8``    B int8 + 1 float32 scale                      ``s * round(x / s)``, ``s = max|x|/127``
``int4``    B/2 bytes (codes -7..7) + 1 float32 scale     ``s * round(x / s)``, ``s = max|x|/7``
``fp4``     B/2 bytes (E3M0 codes) + 1 float32 scale      ``s * 2**-k`` (k = 0..6) or 0, sign
``2bit``    B/4 bytes (ternary codes) + 1 float32 scale   ``s * {-1, 0, 1}``, ``s = max|x|``
``topk``    k (index, value) pairs, values by an inner    the k largest-magnitude elements of
            codec                                         each chunk, zero elsewhere
==========  ===========================================  =====================================

FP4 E3M0 (1 sign bit, 3 exponent bits, no mantissa, as in Streaming DiLoCo): code 0 is zero,
codes 1..7 are ``s * 2**(code - 7)``; a magnitude rounds to the nearest of those (in the
linear domain), so the error is at most a third of the value, or half the smallest level.
The 2-bit format is ternary (one code unused) so that zeros stay exact; its error is at most
``s / 2``. int4 is symmetric: codes -7..7 (the two's-complement -8 unused, so that the
format is sign-symmetric), two per byte by planes (byte j of a block holds elements j, low
nibble, and j + B/2, high nibble), rounded half to even; its error is at most ``s / 2``.
Zeros are exact in every format; a block of zeros has scale 0 and decodes to zeros.
The int8, FP4 and 2-bit arithmetic is the plain-jnp reference of the Pallas kernels
(:mod:`co2jax.kernels.quantize`); with ``block=128`` the kernels themselves run where
``implementation`` resolves to them.

Non-finite input is not clipped or hidden: a NaN or Inf in a block makes that block's scale
non-finite and the whole block decodes to NaN, so :func:`co2jax.skip_nonfinite` still sees
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_choice, check_int
from co2jax.comm.select import scatter_rows, top_k_by_magnitude
from co2jax.kernels import quantize as qk
from co2jax.kernels.api import check_implementation, resolve
from co2jax.kernels.spec import LANES

FORMATS = ("none", "bf16", "fp8", "int8", "int4", "fp4", "2bit", "topk")
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
      sparse: the encoding selects entries and carries their indices (top-k): decoded and
        encoded again, it would select anew and lose its support.
    """

    name: str
    encode: Callable[[jax.Array], Any]
    decode: Callable[[Any, int], jax.Array]
    wire_bytes: Callable[[int], int]
    decode_mean: Callable[[Any, int], jax.Array] | None = None
    block: int | None = None
    sparse: bool = False

    def roundtrip(self, x: jax.Array) -> jax.Array:
        """``decode(encode(x))`` for a vector."""
        return self.decode(self.encode(x), x.shape[0])

    def mean_of(self, gathered: Any, n: int, weights: jax.Array | None = None) -> jax.Array:
        """The float32 mean of the R encoded payloads stacked in ``gathered`` (with
        ``weights``, [R]: the weighted mean, decoded one by one)."""
        if self.decode_mean is not None and weights is None:
            return self.decode_mean(gathered, n)
        replicas = jax.tree.leaves(gathered)[0].shape[0]
        total = jnp.zeros((n,), jnp.float32)
        for i in range(replicas):
            w = 1.0 if weights is None else weights[i].astype(jnp.float32)
            total = total + w * self.decode(jax.tree.map(lambda e, i=i: e[i], gathered), n)
        return total / (replicas if weights is None else jnp.sum(weights).astype(jnp.float32))


def blocks(x: jax.Array, block: int) -> jax.Array:
    """``x`` (1-D) as float32 ``[ceil(n / block), block]``, the last block zero-padded."""
    n = x.shape[0]
    return jnp.pad(x.astype(jnp.float32), (0, (-n) % block)).reshape(-1, block)


def _nblocks(n: int, block: int) -> int:
    return -(-n // block)


def _check_block(block: int, multiple: int = 1) -> int:
    block = check_int("block", block, 1)
    if block % multiple:
        raise ValueError(f"block must be a multiple of {multiple}, got block={block!r}")
    return block


def _uses_kernel(block: int, implementation: str) -> bool:
    """Whether a codec encodes with its Pallas kernel: ``block=128`` and ``implementation``
    resolving to a kernel (:func:`co2jax.kernels.api.resolve`)."""
    return block == LANES and resolve(implementation) != "xla"


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
        xb = blocks(x, block)
        scale = jnp.max(jnp.abs(xb), axis=1) / _E4M3_MAX
        safe = jnp.where(scale > 0, scale, 1.0)[:, None]
        return (xb / safe).astype(jnp.float8_e4m3fn), scale

    def decode(enc, n):
        q, scale = enc
        return (q.astype(jnp.float32) * scale[:, None]).reshape(-1)[:n]

    return Codec("fp8", encode, decode, lambda n: _nblocks(n, block) * (block + 4), block=block)


def int8(block: int = 128, implementation: str = "auto") -> Codec:
    """Symmetric int8 with a float32 scale per ``block`` elements (``max|x|`` maps to 127).

    With ``block=128`` encoding (:func:`co2jax.kernels.quantize.quantize_int8`) and the
    decode-and-average of R gathered payloads (``dequantize_mean_int8``) run the Pallas
    kernels as ``implementation`` says (``"auto"``: the kernels on TPU, XLA elsewhere).
    """
    block = _check_block(block)
    check_implementation(implementation)

    def encode(x):
        xb = blocks(x, block)
        if _uses_kernel(block, implementation):
            return qk.quantize_int8(xb, implementation=implementation)
        return qk.quantize_int8_reference(xb)

    def decode(enc, n):
        q, scale = enc
        return qk.dequantize_mean_int8_reference(q[None], scale[None]).reshape(-1)[:n]

    def decode_mean(gathered, n):
        q, scale = gathered
        mean = qk.dequantize_mean_int8(q, scale, implementation=implementation)
        return mean.reshape(-1)[:n]

    wire = lambda n: _nblocks(n, block) * (block + 4)
    return Codec("int8", encode, decode, wire, decode_mean if block == LANES else None, block)


def int4(block: int = 128) -> Codec:
    """Symmetric int4 with a float32 scale per ``block`` elements (``max|x|`` maps to 7).

    ``q = round(x / s)`` (half to even) in -7..7, ``s = max|x| / 7``, two codes per byte
    (two's complement nibbles, by planes: byte j holds elements j and j + block/2). Plain
    jnp, no kernel. A block whose scale is not finite (a NaN or an Inf in it) decodes to NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> c = int4(block=4)
      >>> c.roundtrip(jnp.array([7.0, -1.4, 0.5, 2.0]))  # s = 1: 0.5 rounds to even 0
      Array([ 7., -1.,  0.,  2.], dtype=float32)
      >>> c.wire_bytes(4)  # 2 bytes of codes + a float32 scale
      6
    """
    block = _check_block(block, 2)
    half = block // 2

    def encode(x):
        xb = blocks(x, block)
        scale = jnp.max(jnp.abs(xb), axis=1) / 7.0
        safe = jnp.where(scale > 0, scale, 1.0)[:, None]
        q = jnp.clip(jnp.round(xb / safe), -7.0, 7.0)
        nibbles = jnp.where(jnp.isfinite(q), q, 0.0).astype(jnp.int32) & 15
        return (nibbles[:, :half] | (nibbles[:, half:] << 4)).astype(jnp.uint8), scale

    def decode(enc, n):
        packed, scale = enc
        p = packed.astype(jnp.int32)
        codes = jnp.concatenate([p & 15, p >> 4], axis=-1)
        codes = jnp.where(codes >= 8, codes - 16, codes).astype(jnp.float32)
        out = jnp.where(jnp.isfinite(scale)[:, None], codes * scale[:, None], jnp.nan)
        return out.reshape(-1)[:n]

    wire = lambda n: _nblocks(n, block) * (half + 4)
    return Codec("int4", encode, decode, wire, block=block)


def _packed(fmt: str, block: int, implementation: str) -> Codec:
    """FP4 or 2-bit codes with one ``max|x|`` scale per block, packed by planes."""
    check_implementation(implementation)
    bits = qk.PACKED_BITS[fmt]

    def encode(x):
        xb = blocks(x, block)
        if _uses_kernel(block, implementation):
            return qk.quantize_packed(xb, fmt, implementation=implementation)
        return qk.quantize_packed_reference(xb, fmt)

    def decode(enc, n):
        packed, scale = enc
        mean = qk.dequantize_mean_packed_reference(packed[None], scale[None], fmt)
        return mean.reshape(-1)[:n]

    def decode_mean(gathered, n):
        packed, scale = gathered
        mean = qk.dequantize_mean_packed(packed, scale, fmt, implementation=implementation)
        return mean.reshape(-1)[:n]

    wire = lambda n: _nblocks(n, block) * (block * bits // 8 + 4)
    return Codec(fmt, encode, decode, wire, decode_mean if block == LANES else None, block)


def fp4(block: int = 128, implementation: str = "auto") -> Codec:
    """FP4 E3M0: sign and a power of two ``s * 2**-k`` (k = 0..6) or zero, ``s = max|x|``.

    With ``block=128`` encoding and the collective's decode-and-average run the Pallas
    kernels of :mod:`co2jax.kernels.quantize` as ``implementation`` says (``"auto"``: on TPU).
    """
    return _packed("fp4", _check_block(block, 2), implementation)


def two_bit(block: int = 128, implementation: str = "auto") -> Codec:
    """Ternary in 2 bits: ``s * {-1, 0, 1}`` with ``s = max|x|`` per block (``block=128``:
    the Pallas kernels, as for :func:`fp4`)."""
    return _packed("2bit", _check_block(block, 4), implementation)


def topk(k: int, chunk: int = 4096, values: Codec | None = None) -> Codec:
    """The ``k`` largest-magnitude elements of every ``chunk`` (indices + values).

    Indices are uint16 within the chunk (``chunk <= 65536``); the k values per chunk are
    encoded by ``values`` (default float32; SparseLoCo uses :func:`two_bit` with
    ``block=k``). Elements not selected decode to zero. The encoding carries the support:
    a selected value that quantizes to zero is still a selected index (see
    :func:`co2jax.comm.all_gather_topk`).
    """
    chunk = check_int("chunk", chunk, 1)
    k = check_int("k", k, 1)
    if k > chunk or chunk > 65536:
        raise ValueError(f"need 1 <= k <= chunk <= 65536, got k={k!r}, chunk={chunk!r}")
    values = none() if values is None else values

    def encode(x):
        idx, picked = top_k_by_magnitude(blocks(x, chunk), k)
        return idx.astype(jnp.uint16), values.encode(picked.reshape(-1))

    def decode(enc, n):
        idx, vals = enc
        chunks = idx.shape[0]
        picked = values.decode(vals, chunks * k).reshape(chunks, k)
        out = scatter_rows(idx.astype(jnp.int32), picked.astype(jnp.float32), chunk)
        return out.reshape(-1)[:n]

    def wire_bytes(n):
        chunks = _nblocks(n, chunk)
        return chunks * k * 2 + values.wire_bytes(chunks * k)

    name = f"topk{k}/{chunk}+{values.name}"
    return Codec(name, encode, decode, wire_bytes, block=chunk, sparse=True)


def support(encoded: Any, chunk: int, n: int) -> jax.Array:
    """The float32 0/1 indicator of the indices a :func:`topk` encoding selected."""
    idx = encoded[0].astype(jnp.int32)
    return scatter_rows(idx, jnp.ones(idx.shape, jnp.float32), chunk).reshape(-1)[:n]


def make(name: str, **options) -> Codec:
    """The codec named ``name`` (one of ``FORMATS``) with its options."""
    makers = {
        "none": none,
        "bf16": bf16,
        "fp8": fp8,
        "int8": int8,
        "int4": int4,
        "fp4": fp4,
        "2bit": two_bit,
        "topk": topk,
    }
    check_choice("compression", name, FORMATS)
    return makers[name](**options)
