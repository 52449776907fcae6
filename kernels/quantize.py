"""Pallas kernels for int8 pseudo-gradients: per-row quantize, and dequantize-and-average.

The layout is the fused update's: 128-lane rows, one float32 scale per row (a block of the
int8 codec of :mod:`co2jax.comm` with ``block=128``). Two kernels, each one pass over memory:

- :func:`quantize_int8`: ``x [rows, 128] -> (q int8 [rows, 128], scale f32 [rows])`` with
  ``scale = max|x| / 127`` per row and ``q = round(x / scale)``;
- :func:`dequantize_mean_int8`: the R gathered ``(q, scale)`` of a compressed all-gather ->
  their float32 mean ``[rows, 128]``: decoding R payloads and reducing them without writing
  R decoded copies.

Each has a plain-jnp reference beside it (``*_reference``) and takes ``implementation=``
(``"xla"``, ``"pallas"``, ``"interpret"``, ``"auto"``: XLA except on TPU) like
:func:`co2jax.kernels.outer_update`.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from co2jax.kernels.api import current_backend, resolve
from co2jax.kernels.layout import as_column, as_row, typed_call
from co2jax.kernels.spec import LANES, BlockSizes, default_block_sizes


def quantize_int8_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(round(x / s), s)`` per row, ``s = max|x| / 127`` (0 for a zero row)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    return jnp.round(x / safe).astype(jnp.int8), scale


def dequantize_mean_int8_reference(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``mean_r q_r * s_r`` in float32 (``q [R, rows, 128]``, ``scale [R, rows]``)."""
    return jnp.mean(q.astype(jnp.float32) * scale[..., None], axis=0)


def _round_half_even(y: jax.Array) -> jax.Array:
    """``jnp.round`` from floor (Triton has no round primitive): ties go to the even one."""
    f = jnp.floor(y)
    d = y - f
    odd = f - 2.0 * jnp.floor(0.5 * f)  # 1 for odd f, 0 for even
    return jnp.where(d > 0.5, f + 1.0, jnp.where(d < 0.5, f, f + odd))


def _quantize_kernel(x_ref, q_ref, s_ref):
    x = x_ref[...].astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q_ref[...] = _round_half_even(x / safe).astype(jnp.int8)
    s_ref[...] = as_row(scale)


def _dequantize_mean_kernel(q_ref, s_ref, o_ref, *, replicas: int):
    total = None
    for r in range(replicas):
        value = q_ref[r].astype(jnp.float32) * as_column(s_ref[pl.ds(r, 1), :])
        total = value if total is None else total + value
    o_ref[...] = total * (1.0 / replicas)


def _cost(*operands) -> pl.CostEstimate:
    """Every operand read or written once (arrays, or ``(*shape, dtype)`` tuples): what the
    kernel's block pipeline moves; XLA reports it for the otherwise opaque Mosaic call."""
    moved = 0
    for x in operands:
        shape, dtype = (x.shape, x.dtype) if hasattr(x, "shape") else (x[:-1], x[-1])
        moved += math.prod(shape) * jnp.dtype(dtype).itemsize
    return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=moved)


def _params(backend: str, interpret: bool):
    if interpret:
        return None
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _resolve(
    implementation: str, replicas: int | None = None, backend: str | None = None
) -> tuple[str, str]:
    """The implementation (:func:`co2jax.kernels.api.resolve`) and the target backend."""
    backend = backend or current_backend()
    return resolve(implementation, replicas, backend), backend


def _encode_call(kernel, x, width, dtype, fmt, impl, backend, block_sizes):
    """``kernel(x_ref, codes_ref, scale_ref)`` over row blocks of ``x [rows, 128]``:
    ``(codes [rows, width] dtype, scale [rows])``, the scales written lane-dense."""
    br = (block_sizes or default_block_sizes(backend)).block_rows
    rows = x.shape[0]
    call = lambda out_shape: pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, br),),
        in_specs=[pl.BlockSpec((br, LANES), lambda i: (i, 0))],
        out_specs=(
            pl.BlockSpec((br, width), lambda i: (i, 0)),
            pl.BlockSpec((1, br), lambda i: (0, i)),
        ),
        compiler_params=_params(backend, impl == "interpret"),
        cost_estimate=_cost(x, (rows, width, dtype), (rows, jnp.float32)),
        interpret=impl == "interpret",
        name=f"co2jax_quantize_{fmt}",
    )
    out_shape = (
        jax.ShapeDtypeStruct((rows, width), dtype),
        jax.ShapeDtypeStruct((1, rows), jnp.float32),
    )
    codes, scale = typed_call(call, out_shape, x, compiled=impl != "interpret")
    return codes, scale[0]


def _mean_call(kernel, codes, scale, fmt, impl, backend, block_sizes):
    """``kernel(codes_ref, scale_ref, out_ref, replicas=R)`` over row blocks of R payloads
    ``codes [R, rows, width]`` with lane-dense ``scale [R, rows]``: their float32 mean
    ``[rows, 128]``."""
    replicas, rows, width = codes.shape
    br = (block_sizes or default_block_sizes(backend)).block_rows
    call = lambda out_shape: pl.pallas_call(
        functools.partial(kernel, replicas=replicas),
        out_shape=out_shape,
        grid=(pl.cdiv(rows, br),),
        in_specs=[
            pl.BlockSpec((replicas, br, width), lambda i: (0, i, 0)),
            pl.BlockSpec((replicas, br), lambda i: (0, i)),
        ],
        out_specs=pl.BlockSpec((br, LANES), lambda i: (i, 0)),
        compiler_params=_params(backend, impl == "interpret"),
        cost_estimate=_cost(codes, scale, (rows, LANES, jnp.float32)),
        interpret=impl == "interpret",
        name=f"co2jax_dequantize_mean_{fmt}",
    )
    return typed_call(
        call,
        jax.ShapeDtypeStruct((rows, LANES), jnp.float32),
        codes,
        scale,
        compiled=impl != "interpret",
    )


def quantize_int8(
    x: jax.Array,
    *,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-row int8 quantization of ``x [rows, 128]``: ``(q [rows, 128] int8, scale [rows])``.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = quantize_int8(jnp.full((1, 128), -2.54), implementation="interpret")
      >>> int(q[0, 0]), float(s[0])
      (-127, 0.02)
    """
    impl, backend = _resolve(implementation, None, backend)
    if x.ndim != 2 or x.shape[1] != LANES:
        raise ValueError(f"x must be [rows, {LANES}], got shape {x.shape}")
    if impl == "xla":
        return quantize_int8_reference(x)
    return _encode_call(_quantize_kernel, x, LANES, jnp.int8, "int8", impl, backend, block_sizes)


def dequantize_mean_int8(
    q: jax.Array,
    scale: jax.Array,
    *,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> jax.Array:
    """The float32 mean of R int8 payloads ``q [R, rows, 128]`` with scales ``[R, rows]``."""
    impl, backend = _resolve(implementation, q.shape[0] if q.ndim == 3 else None, backend)
    if q.ndim != 3 or q.shape[2] != LANES or scale.shape != q.shape[:2]:
        raise ValueError(
            f"need q [R, rows, {LANES}] and scale [R, rows], got {q.shape}, {scale.shape}"
        )
    if impl == "xla":
        return dequantize_mean_int8_reference(q, scale)
    return _mean_call(_dequantize_mean_kernel, q, scale, "int8", impl, backend, block_sizes)


# ---------------------------------------------------------------------------------------------
# 4-bit (FP4 E3M0) and 2-bit (ternary) codes, packed by planes


_FP4_LEVELS = [2.0**k for k in range(-6, 1)]  # code c in 1..7 is 2**(c - 7)
_FP4_MIDS = [_FP4_LEVELS[0] / 2] + [(a + b) / 2 for a, b in itertools.pairwise(_FP4_LEVELS)]
PACKED_BITS = {"fp4": 4, "2bit": 2}


def _codes(fmt: str, x: jax.Array, scale: jax.Array) -> jax.Array:
    """int32 codes of ``x`` (float32) against its block's ``scale = max|x|``."""
    r = x / jnp.where(scale > 0, scale, 1.0)
    if fmt == "fp4":
        a = jnp.abs(r)
        code = jnp.zeros(x.shape, jnp.int32)
        for mid in _FP4_MIDS:  # nearest level in the linear domain; below the first, zero
            code = code + (a >= mid).astype(jnp.int32)
        return jnp.where(r < 0, code + 8, code)
    return jnp.where(r >= 0.5, 1, jnp.where(r <= -0.5, 2, 0)).astype(jnp.int32)


def _values(fmt: str, code: jax.Array) -> jax.Array:
    """float32 value of int32 codes for a unit scale."""
    if fmt == "fp4":
        c = code & 7
        mag = jnp.zeros(code.shape, jnp.float32)
        for k, level in enumerate(_FP4_LEVELS, start=1):
            mag = jnp.where(c == k, level, mag)
        return jnp.where(code >= 8, -mag, mag)
    return jnp.where(code == 1, 1.0, jnp.where(code == 2, -1.0, 0.0))


def quantize_packed_reference(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Codes of each row of ``x [rows, B]`` (any B that the codes per byte divide) against
    the row's ``scale = max|x|``, packed by planes (byte j holds codes j, j + B/per, ...,
    lowest bits first): ``(packed uint8 [rows, B * bits / 8], scale f32 [rows])``."""
    bits = PACKED_BITS[fmt]
    per = 8 // bits
    x = x.astype(jnp.float32)
    rows, width = x.shape
    scale = jnp.max(jnp.abs(x), axis=1)
    codes = _codes(fmt, x, scale[:, None]).reshape(rows, per, width // per)
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits)[None, :, None]
    return jnp.sum(codes << shifts, axis=1).astype(jnp.uint8), scale


def dequantize_mean_packed_reference(packed: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
    """The float32 mean ``[rows, B]`` of R packed payloads ``[R, rows, B * bits / 8]`` with
    scales ``[R, rows]`` (R = 1: one payload decoded)."""
    bits = PACKED_BITS[fmt]
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits)[None, None, :, None]
    codes = (packed.astype(jnp.int32)[:, :, None, :] >> shifts) & ((1 << bits) - 1)
    replicas, rows = packed.shape[:2]
    values = _values(fmt, codes.reshape(replicas, rows, -1)) * scale[..., None]
    return jnp.mean(values, axis=0)


def _quantize_packed_kernel(x_ref, p_ref, s_ref, *, fmt: str):
    per = 8 // PACKED_BITS[fmt]
    width = LANES // per
    x = x_ref[...].astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    packed = jnp.zeros((x.shape[0], width), jnp.int32)
    for k in range(per):  # plane k: lanes [k * width, (k + 1) * width)
        plane = x_ref[:, k * width : (k + 1) * width].astype(jnp.float32)
        packed = packed | (_codes(fmt, plane, scale) << (k * PACKED_BITS[fmt]))
    p_ref[...] = packed.astype(jnp.uint8)
    s_ref[...] = as_row(scale)


def _dequantize_mean_packed_kernel(p_ref, s_ref, o_ref, *, fmt: str, replicas: int):
    bits = PACKED_BITS[fmt]
    per = 8 // bits
    width = LANES // per
    for k in range(per):
        total = None
        for r in range(replicas):
            code = (p_ref[r].astype(jnp.int32) >> (k * bits)) & ((1 << bits) - 1)
            value = _values(fmt, code) * as_column(s_ref[pl.ds(r, 1), :], width)
            total = value if total is None else total + value
        o_ref[:, k * width : (k + 1) * width] = total * (1.0 / replicas)


def _check_fmt(fmt: str) -> int:
    if fmt not in PACKED_BITS:
        raise ValueError(f"fmt must be one of {tuple(PACKED_BITS)}, got fmt={fmt!r}")
    return LANES * PACKED_BITS[fmt] // 8


def quantize_packed(
    x: jax.Array,
    fmt: str,
    *,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """FP4 E3M0 (``fmt="fp4"``) or ternary 2-bit (``"2bit"``) codes of ``x [rows, 128]``, one
    scale ``max|x|`` per row, packed by planes: ``(packed uint8 [rows, 64 or 32], scale)``.

    Bit for bit :func:`quantize_packed_reference`, which is the encoding of the ``fp4`` /
    ``two_bit`` codecs of :mod:`co2jax.comm`.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.zeros((1, 128)).at[0, 0].set(-4.0).at[0, 64].set(1.0)
      >>> p, s = quantize_packed(x, "fp4", implementation="interpret")
      >>> int(p[0, 0]), float(s[0])  # low nibble: -2**0 (code 15); high: 2**-2 (code 5)
      (95, 4.0)
    """
    width = _check_fmt(fmt)
    impl, backend = _resolve(implementation, None, backend)
    if x.ndim != 2 or x.shape[1] != LANES:
        raise ValueError(f"x must be [rows, {LANES}], got shape {x.shape}")
    if impl == "xla":
        return quantize_packed_reference(x, fmt)
    kernel = functools.partial(_quantize_packed_kernel, fmt=fmt)
    return _encode_call(kernel, x, width, jnp.uint8, fmt, impl, backend, block_sizes)


def dequantize_mean_packed(
    packed: jax.Array,
    scale: jax.Array,
    fmt: str,
    *,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> jax.Array:
    """The float32 mean ``[rows, 128]`` of R packed payloads ``[R, rows, 64 or 32]`` with
    scales ``[R, rows]``, decoded and summed in one pass."""
    width = _check_fmt(fmt)
    impl, backend = _resolve(implementation, packed.shape[0] if packed.ndim == 3 else None, backend)
    if packed.ndim != 3 or packed.shape[2] != width or scale.shape != packed.shape[:2]:
        raise ValueError(
            f"need packed [R, rows, {width}] and scale [R, rows], got {packed.shape}, {scale.shape}"
        )
    if impl == "xla":
        return dequantize_mean_packed_reference(packed, scale, fmt)
    kernel = functools.partial(_dequantize_mean_packed_kernel, fmt=fmt)
    return _mean_call(kernel, packed, scale, fmt, impl, backend, block_sizes)
