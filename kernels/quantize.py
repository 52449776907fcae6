"""Pallas kernels for int8 pseudo-gradients: per-row quantize, and dequantize-and-average.

The layout is the fused update's: 128-lane rows, one float32 scale per row (a block of
:func:`co2jax.compression.int8` with ``block=128``). Two kernels, each one pass over memory:

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from co2jax.kernels.api import check_implementation, current_backend
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
    s_ref[...] = scale


def _dequantize_mean_kernel(q_ref, s_ref, o_ref, *, replicas: int):
    total = q_ref[0].astype(jnp.float32) * s_ref[0]
    for r in range(1, replicas):
        total = total + q_ref[r].astype(jnp.float32) * s_ref[r]
    o_ref[...] = total * (1.0 / replicas)


def _params(backend: str, interpret: bool):
    if interpret:
        return None
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _resolve(implementation: str) -> tuple[str, str]:
    check_implementation(implementation)
    backend = current_backend()
    if implementation == "auto":
        implementation = "pallas" if backend == "tpu" else "xla"
    if implementation == "pallas" and backend not in ("tpu", "gpu", "cuda", "rocm"):
        implementation = "xla"  # no Pallas lowering for this backend: the reference
    return implementation, backend


def quantize_int8(
    x: jax.Array, *, implementation: str = "auto", block_sizes: BlockSizes | None = None
) -> tuple[jax.Array, jax.Array]:
    """Per-row int8 quantization of ``x [rows, 128]``: ``(q [rows, 128] int8, scale [rows])``.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = quantize_int8(jnp.full((1, 128), -2.54), implementation="interpret")
      >>> int(q[0, 0]), float(s[0])
      (-127, 0.02)
    """
    impl, backend = _resolve(implementation)
    if x.ndim != 2 or x.shape[1] != LANES:
        raise ValueError(f"x must be [rows, {LANES}], got shape {x.shape}")
    if impl == "xla":
        return quantize_int8_reference(x)
    br = (block_sizes or default_block_sizes(backend)).block_rows
    rows = x.shape[0]
    q, s = pl.pallas_call(
        _quantize_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((rows, LANES), jnp.int8),
            jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        ),
        grid=(pl.cdiv(rows, br),),
        in_specs=[pl.BlockSpec((br, LANES), lambda i: (i, 0))],
        out_specs=(
            pl.BlockSpec((br, LANES), lambda i: (i, 0)),
            pl.BlockSpec((br, 1), lambda i: (i, 0)),
        ),
        compiler_params=_params(backend, impl == "interpret"),
        interpret=impl == "interpret",
        name="co2jax_quantize_int8",
    )(x)
    return q, s[:, 0]


def dequantize_mean_int8(
    q: jax.Array,
    scale: jax.Array,
    *,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """The float32 mean of R int8 payloads ``q [R, rows, 128]`` with scales ``[R, rows]``."""
    impl, backend = _resolve(implementation)
    if q.ndim != 3 or q.shape[2] != LANES or scale.shape != q.shape[:2]:
        raise ValueError(
            f"need q [R, rows, {LANES}] and scale [R, rows], got {q.shape}, {scale.shape}"
        )
    if impl == "xla":
        return dequantize_mean_int8_reference(q, scale)
    replicas, rows, _ = q.shape
    br = (block_sizes or default_block_sizes(backend)).block_rows
    return pl.pallas_call(
        functools.partial(_dequantize_mean_kernel, replicas=replicas),
        out_shape=jax.ShapeDtypeStruct((rows, LANES), jnp.float32),
        grid=(pl.cdiv(rows, br),),
        in_specs=[
            pl.BlockSpec((replicas, br, LANES), lambda i: (0, i, 0)),
            pl.BlockSpec((replicas, br, 1), lambda i: (0, i, 0)),
        ],
        out_specs=pl.BlockSpec((br, LANES), lambda i: (i, 0)),
        compiler_params=_params(backend, impl == "interpret"),
        interpret=impl == "interpret",
        name="co2jax_dequantize_mean_int8",
    )(q, scale[..., None])
