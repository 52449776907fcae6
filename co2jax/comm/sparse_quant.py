"""SparseLoCo's production quantizer: per tensor, the top k of every tile in 2-bit codes over
four asymmetric bins, then a median-norm clip and a mean over the contributors.

Each leaf of the payload (a tensor) is handled on its own, as the authors' released code does
(``src/tplr/compress.py`` of their trainer; arXiv 2603.08163):

1. **Tiles.** A leaf of two or more axes is viewed as a matrix ``[m, n]`` (the first axis by
   the rest) and cut into ``h x w`` tiles, ``h`` the largest divisor of ``m`` that is at most
   ``tile[0]`` (``m`` itself when smaller) and ``w`` likewise for ``n``: a dimension that is not
   a multiple of 64 gets smaller tiles, never padding. A leaf of one axis (or none) is cut
   into chunks of the largest divisor of its size that is at most ``chunk`` (the released
   code uses its tile side, 64, here too: ``chunk=64``, where k = 64 sends such a leaf whole).
2. **Top-k.** Each chunk keeps its ``k`` largest magnitudes (ties: the lower index; the
   released top-k leaves their order unspecified), with ``k`` clamped as released: to the
   chunk's size, then at least 2, then rounded down to even (and here at most the size).
3. **Quantizer**, over all n values v the leaf keeps (every chunk's together):

   .. math::

       s = \\operatorname{mean}(v), \\quad c = v - s, \\quad
       \\sigma = \\lVert c \\rVert_2 / \\sqrt{n - 1}, \\quad \\delta = \\rho\\,\\sigma / B \\\\
       q = \\operatorname{clamp}(\\operatorname{round}(c / \\delta + B/2), 0, B - 1), \\quad
       L_b = \\operatorname{mean}\\{c_j : q_j = b\\} \\ (0 \\text{ if empty}), \\quad
       \\hat v = L_q + s

   with B = 4 bins and rho = 6 sigmas: 2-bit codes. Rounding is half to even; a scale that is
   0 or not finite (constant values; n = 1, where 0/0) is replaced by 1, as released.
4. **Aggregation** (:meth:`_Quantized.combine`), per leaf over the R replicas' decoded values:
   each replica's values are scaled by ``min(med / (||v_r|| + 1e-8), 1)``, ``med`` the median
   of the R norms (``torch.median``'s: the lower of the two middle ones when R is even), then
   each index is averaged over the replicas that selected it (``average="contributors"``, the
   code) or divided by R (``"replicas"``, the paper's formula).

On the wire, per leaf: 2 + B float32 (s, delta, the B lookup values), the indices within the
chunk packed at 12 bits (two in three bytes, as released, so a chunk holds at most 4096
elements), the codes packed four to a byte (the released code sends one uint8 per code: 8
bits, where the paper counts 2). :func:`all_gather_topk_quantized` sends one uint8 buffer
per group of leaves (:func:`co2jax.tree.varying_groups`), and ``wire_bytes`` counts exactly
its bytes: at k = 64 of every 64x64 tile, (12 + 2) * 64 / 4096 = 0.219 bits per parameter of
a 4096x4096 matrix, 146x below float32.

Deviations, all at the edges: a leaf of more than two axes (the released chunker accepts only
one or two) is viewed as ``[shape[0], prod(shape[1:])]``; a chunk of one element keeps that
element (k = 1); and with R = 1 nothing is clipped (the released factor
``norm / (norm + 1e-8)`` differs from 1 by at most 1e-8 / norm), so that decoding one encoding
(what error feedback subtracts) is the plain dequantized value, as released.

References:
  Sarfi et al., "SparseLoCo: Communication-Efficient LLM Training", arXiv 2508.15706;
  Covenant-72B, arXiv 2603.08163.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_choice, check_int, check_positive
from co2jax.axes import REPLICA
from co2jax.comm.codecs import Codec
from co2jax.comm.reducer import (
    Encoded,
    Grouped,
    Payload,
    Reducer,
    check_whole_leaves,
    gather_bytes,
    gather_reduce,
    per_contributor,
)
from co2jax.comm.select import lookup, scatter_rows, top_k_by_magnitude

BINS = (2, 4, 16, 256)
"""Bin counts whose codes pack whole into bytes (1, 2, 4 or 8 bits)."""
MAX_CHUNK = 4096
"""Elements per chunk at most: indices within a chunk are sent in 12 bits."""
AVERAGES = ("contributors", "replicas")
CLIP_EPS = 1e-8
"""The clip factor's guard, ``med / (norm + CLIP_EPS)``, as released."""


def _divisor_at_most(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (``n`` itself when smaller)."""
    if n <= target:
        return n
    return next(d for d in range(target, 0, -1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one leaf is cut into chunks and what it sends (static).

    Attributes:
      shape: the leaf's shape.
      matrix: the leaf viewed as ``(m, n)``.
      tile: ``(h, w)``, the shape of every chunk within the matrix.
      k: values kept per chunk.
      bins: quantizer bins.
    """

    shape: tuple[int, ...]
    matrix: tuple[int, int]
    tile: tuple[int, int]
    k: int
    bins: int

    @property
    def chunk(self) -> int:
        return self.tile[0] * self.tile[1]

    @property
    def chunks(self) -> int:
        return (self.matrix[0] // self.tile[0]) * (self.matrix[1] // self.tile[1])

    @property
    def values(self) -> int:
        """Values the leaf sends (n of the quantizer)."""
        return self.chunks * self.k

    @property
    def bits(self) -> int:
        return self.bins.bit_length() - 1

    @property
    def segments(self) -> tuple[int, int, int]:
        """Bytes of the metadata (float32), the 12-bit indices and the packed codes."""
        if not self.values:
            return 0, 0, 0
        n = self.values
        return 4 * (2 + self.bins), 3 * math.ceil(n / 2), math.ceil(n * self.bits / 8)

    @property
    def nbytes(self) -> int:
        return sum(self.segments)

    def split(self, x: jax.Array) -> jax.Array:
        """The leaf as ``[chunks, h * w]``, chunks in row-major tile order."""
        (m, n), (h, w) = self.matrix, self.tile
        x = x.reshape(m // h, h, n // w, w).transpose(0, 2, 1, 3)
        return x.reshape(self.chunks, self.chunk)

    def join(self, xc: jax.Array) -> jax.Array:
        (m, n), (h, w) = self.matrix, self.tile
        x = xc.reshape(m // h, n // w, h, w).transpose(0, 2, 1, 3)
        return x.reshape(self.shape)


def tiling(
    shape: tuple[int, ...],
    k: int = 64,
    tile: tuple[int, int] = (64, 64),
    chunk: int = 4096,
    bins: int = 4,
) -> Tiling:
    """The :class:`Tiling` of a leaf of ``shape`` (see the module docstring, steps 1-2).

    Example:
      >>> t = tiling((96, 200))  # 96 = 2 * 48, 200 = 4 * 50: tiles of 48x50
      >>> t.tile, t.chunks, t.k
      ((48, 50), 8, 64)
    """
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if len(shape) <= 1:
        matrix = (1, size)
        tile_hw = (1, _divisor_at_most(size, chunk) if size else 1)
    else:
        matrix = (shape[0], size // shape[0] if shape[0] else 0)
        tile_hw = tuple(
            _divisor_at_most(d, t) if d else 1 for d, t in zip(matrix, tile, strict=True)
        )
    t = Tiling(shape, matrix, tile_hw, 0, bins)
    kept = max(min(k, t.chunk), 2)
    kept = min(kept - kept % 2, t.chunk)
    return dataclasses.replace(t, k=kept if size else 0)


def quantize_values(
    v: jax.Array, bins: int = 4, range_sigmas: float = 6.0
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The released quantizer on all of ``v`` (one tensor's kept values): ``(codes, shift,
    scale, lookup)``, codes uint8 shaped like ``v`` (step 3 of the module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> codes, shift, scale, lookup = quantize_values(jnp.array([-3.0, -1.0, 1.0, 3.0]))
      >>> codes, shift, lookup  # sigma = sqrt(20/3), scale = 1.5 * sigma: bins 1, 2, 2, 3
      (Array([1, 2, 2, 3], dtype=uint8), Array(0., dtype=float32),
       Array([ 0., -3.,  0.,  3.], dtype=float32))
    """
    v = v.astype(jnp.float32)
    n = v.size
    shift = jnp.mean(v)
    centered = v - shift
    # n = 1: 0 / 0 is NaN, which the fallback below turns into a scale of 1, as released
    sigma = jnp.sqrt(jnp.sum(jnp.square(centered))) / jnp.float32(math.sqrt(n - 1))
    scale = range_sigmas * sigma / bins
    scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.float32(1.0), scale)
    codes = jnp.clip(jnp.round(centered / scale + bins // 2), 0, bins - 1).astype(jnp.uint8)
    flat = codes.reshape(-1).astype(jnp.int32)
    sums = jnp.zeros((bins,), jnp.float32).at[flat].add(centered.reshape(-1))
    counts = jnp.zeros((bins,), jnp.float32).at[flat].add(1.0)
    lookup = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    return codes, shift, scale, lookup


def dequantize_values(codes: jax.Array, shift: jax.Array, lookup: jax.Array) -> jax.Array:
    """``lookup[codes] + shift`` in float32."""
    return lookup[codes.astype(jnp.int32)] + shift


def _pack12(idx: jax.Array) -> jax.Array:
    """Indices below 4096 (1-D) as uint8, two in three bytes (an odd count padded with 0)."""
    pairs = jnp.pad(idx.astype(jnp.uint32), (0, idx.size % 2)).reshape(-1, 2)
    a, b = pairs[:, 0], pairs[:, 1]
    packed = jnp.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1)
    return packed.astype(jnp.uint8).reshape(-1)


def _unpack12(packed: jax.Array, n: int) -> jax.Array:
    """``[..., 3 * ceil(n / 2)]`` uint8 back to ``[..., n]`` int32 indices."""
    p = packed.reshape(*packed.shape[:-1], -1, 3).astype(jnp.int32)
    a = p[..., 0] | ((p[..., 1] & 0xF) << 8)
    b = (p[..., 1] >> 4) | (p[..., 2] << 4)
    return jnp.stack([a, b], axis=-1).reshape(*packed.shape[:-1], -1)[..., :n]


def _pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    per = 8 // bits
    q = jnp.pad(codes.astype(jnp.uint32), (0, (-codes.size) % per)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    return jnp.sum(q << shifts, axis=1).astype(jnp.uint8)  # disjoint bits: the sum is an OR


def _unpack_codes(packed: jax.Array, n: int, bits: int) -> jax.Array:
    shifts = jnp.arange(8 // bits, dtype=jnp.int32) * bits
    q = (packed.astype(jnp.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], -1)[..., :n]


def _encode_leaf(x: jax.Array, t: Tiling, range_sigmas: float) -> jax.Array:
    """One leaf's wire bytes: metadata, 12-bit indices, packed codes (``t.nbytes``)."""
    if not t.values:
        return jnp.zeros((0,), jnp.uint8)
    xc = t.split(x.astype(jnp.float32))
    idx, picked = top_k_by_magnitude(xc, t.k)  # a NaN ranks first: it reaches the shift
    codes, shift, scale, lookup = quantize_values(picked, t.bins, range_sigmas)
    meta = jnp.concatenate([shift[None], scale[None], lookup])
    parts = [
        jax.lax.bitcast_convert_type(meta, jnp.uint8).reshape(-1),
        _pack12(idx.reshape(-1)),
        _pack_codes(codes.reshape(-1), t.bits),
    ]
    return jnp.concatenate(parts)


def _decode_leaf(wire: jax.Array, t: Tiling) -> tuple[jax.Array, jax.Array]:
    """R encodings ``[R, t.nbytes]`` -> indices within each chunk and values, ``[R, C, k]``."""
    r = wire.shape[0]
    meta_n, index_n, _ = t.segments
    meta = jax.lax.bitcast_convert_type(wire[:, :meta_n].reshape(r, -1, 4), jnp.float32)
    idx = _unpack12(wire[:, meta_n : meta_n + index_n], t.values)
    codes = _unpack_codes(wire[:, meta_n + index_n :], t.values, t.bits)
    vals = lookup(meta[:, 2:], codes) + meta[:, :1]
    shape = (r, t.chunks, t.k)
    return idx.reshape(shape), vals.reshape(shape)


def _reduce_leaf(wire: jax.Array, t: Tiling, average: str, clip: bool, weights=None) -> jax.Array:
    """The float32 aggregate of R encodings of one leaf (step 4 of the module docstring).
    With ``weights`` ([R]): the median over the replicas of weight > 0, the weighted mean."""
    r = wire.shape[0]
    if not t.values:
        return jnp.zeros(t.shape, jnp.float32)
    idx, vals = _decode_leaf(wire, t)
    if clip and r > 1:
        norms = jnp.sqrt(jnp.sum(jnp.square(vals), axis=(1, 2)))
        if weights is None:
            median = jnp.sort(norms)[(r - 1) // 2]
        else:  # the lower median of the participants' norms
            present = weights > 0
            ranked = jnp.sort(jnp.where(present, norms, jnp.inf))
            median = ranked[(jnp.sum(present) - 1) // 2]
        vals = vals * jnp.minimum(median / (norms + CLIP_EPS), 1.0)[:, None, None]
    w = jnp.ones((r,), jnp.float32) if weights is None else weights.astype(jnp.float32)
    by_chunk = lambda a: jnp.swapaxes(a, 0, 1).reshape(t.chunks, -1)  # [chunks, R k]
    total = scatter_rows(by_chunk(idx), by_chunk(vals * w[:, None, None]), t.chunk, add=True)
    if average == "contributors":
        ones = by_chunk(jnp.broadcast_to(w[:, None, None], idx.shape))
        count = scatter_rows(by_chunk(idx), ones, t.chunk, add=True)
        total = per_contributor(total, count)
    else:
        total = total / (r if weights is None else jnp.sum(w))
    return t.join(total)


@dataclasses.dataclass(frozen=True)
class _Quantized(Grouped):
    """Per group one uint8 buffer, its leaves' wire bytes one after the other; combined per
    leaf by the median clip and the mean (an index nobody selected stays 0)."""

    tilings: tuple[Tiling, ...] = ()
    average: str = "contributors"
    clip: bool = True

    @property
    def per_index(self) -> bool:
        return self.average == "contributors"

    @property
    def per_unit(self) -> int:
        raise ValueError(
            "a production SparseLoCo encoding is clipped per whole tensor: it cannot be cut "
            "into chunks spread over the inner steps (send the transfer whole)"
        )

    def combine(self, data, weights=None) -> Any:
        leaves: list[Any] = [None] * len(self.shapes)
        for group, wire in zip(self.groups, data, strict=True):
            offset = 0
            for i in group:
                t = self.tilings[i]
                piece = wire[:, offset : offset + t.nbytes]
                reduced = _reduce_leaf(piece, t, self.average, self.clip, weights)
                leaves[i] = reduced.astype(self.dtypes[i])
                offset += t.nbytes
        return jax.tree.unflatten(self.treedef, leaves)


def _check_tile(tile: Any) -> tuple[int, int]:
    ok = isinstance(tile, tuple | list) and len(tile) == 2
    if ok:
        h, w = (check_int("tile", d, 1) for d in tile)
        ok = h * w <= MAX_CHUNK
    if not ok:
        raise ValueError(
            f"tile must be (h, w), integers >= 1 with h * w <= {MAX_CHUNK} (12-bit indices), "
            f"got tile={tile!r}"
        )
    return h, w


def all_gather_topk_quantized(
    k: int = 64,
    tile: tuple[int, int] = (64, 64),
    chunk: int = 4096,
    *,
    bins: int = 4,
    range_sigmas: float = 6.0,
    average: str = "contributors",
    clip: bool = True,
    axis_name: str = REPLICA,
) -> Reducer:
    """SparseLoCo's production collective: per leaf, the top ``k`` of every tile quantized
    over ``bins`` bins, all-gathered, clipped to the median norm and averaged per index.

    The steps and the byte layout are in the module docstring. ``encode`` returns one uint8
    buffer per group of leaves (:class:`~co2jax.comm.Encoded`, packed for real: what crosses
    the wire), so it runs under ``jax.vmap``, inside ``jax.shard_map`` (the collective is an
    all-gather by axis name) and between separate jobs that exchange encodings. A leaf split
    over another mesh axis inside ``shard_map`` (a data shard) is refused: a top-k of a
    shard's tiles is another algorithm. The encoding cannot be cut into chunks.

    Args:
      k: values kept per chunk (even; a smaller chunk keeps all of its elements, rounded
        down to even).
      tile: the largest tile ``(h, w)`` of a leaf of two or more axes (``h * w <= 4096``).
      chunk: the largest chunk of a leaf of one axis (``<= 4096``).
      bins: quantizer bins (one of ``BINS``: 4 is 2 bits).
      range_sigmas: the range the bins span, in standard deviations of the kept values.
      average: ``"contributors"`` (each index over the replicas that selected it, as the
        released code) or ``"replicas"`` (over R, the paper's formula).
      clip: scale each replica's values down to the median of the replicas' norms.
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_gather_topk_quantized(4, chunk=8)
      >>> x = jnp.array([[3.0, 0, 0, -3, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, -1]])
      >>> # replica 1 keeps indices 4, 7 and (ties) 0, 1; replica 0's norm is clipped to
      >>> # replica 1's (a third of it); index 0 is averaged over both, index 3 is not
      >>> jax.jit(jax.vmap(reduce, axis_name="replica"))(x)[0]
      Array([ 0.5,  0. ,  0. , -1. ,  1. ,  0. ,  0. , -1. ], dtype=float32)
    """
    k = check_int("k", k, 2)
    if k % 2:
        raise ValueError(f"12-bit indices pack in pairs: k must be even, got k={k!r}")
    h, w = _check_tile(tile)
    chunk = check_int("chunk", chunk, 1)
    if chunk > MAX_CHUNK:
        raise ValueError(f"chunk must be <= {MAX_CHUNK} (12-bit indices), got chunk={chunk!r}")
    if k > MAX_CHUNK:
        raise ValueError(f"k must be <= {MAX_CHUNK} (a chunk's most elements), got k={k!r}")
    check_choice("bins", bins, BINS)
    range_sigmas = check_positive("range_sigmas", range_sigmas)
    check_choice("average", average, AVERAGES)
    check_choice("clip", clip, (True, False))
    check_axis_name("axis_name", axis_name)
    leaf_tiling = lambda shape: tiling(shape, k, (h, w), chunk, bins)

    def encode(payload: Payload) -> Encoded:
        form, groups = Grouped.of(payload)
        check_whole_leaves(groups, axis_name, f"{name} (per-tensor top-k and norm)")
        tilings = tuple(leaf_tiling(s) for s in form.shapes)
        data = tuple(
            jnp.concatenate(
                [_encode_leaf(x, tilings[i], range_sigmas) for x, i in zip(g, gi, strict=True)]
            )
            for g, gi in zip(groups, form.groups, strict=True)
        )
        return Encoded(data, _Quantized(*form.fields(), tilings, average, clip))

    def wire(shapes, replicas: int) -> float:
        leaves = jax.tree.leaves(shapes)
        return gather_bytes(sum(leaf_tiling(x.shape).nbytes for x in leaves), replicas)

    codec = Codec(  # the format on one 1-D tensor (what error feedback checks for)
        f"topk{k}/{h}x{w},{chunk}+quant{bins}",
        lambda x: _encode_leaf(x, leaf_tiling(x.shape), range_sigmas),
        lambda e, n: _reduce_leaf(e[None], leaf_tiling((n,)), average, clip),
        lambda n: leaf_tiling((n,)).nbytes,
        sparse=True,
    )
    name = f"all_gather_topk_quantized({codec.name}, {average})"
    return Reducer(
        name, gather_reduce(encode, axis_name), wire, encode, codec=codec, chunkable=False
    )
