"""The int8, FP4 and 2-bit Pallas kernels against their references (interpreter), and their
lowerings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from co2jax.kernels import BlockSizes
from co2jax.kernels import quantize as qk

BLOCK = BlockSizes(block_rows=32)  # int8 tiles are (32, 128) on TPU


def _x(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 128)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))
    x[::7] = 0.0  # all-zero rows
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("rows", [1, 32, 83])  # one row, one block, a ragged last block
def test_quantize_matches_reference(rows):
    x = _x(rows)
    q, s = qk.quantize_int8(x, implementation="interpret", block_sizes=BLOCK)
    wq, ws = qk.quantize_int8_reference(x)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(s, ws)
    assert q.dtype == jnp.int8 and s.shape == (rows,)


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("rows", [1, 83])
@pytest.mark.cases("each")
def test_dequantize_mean_matches_reference(replicas, rows):
    qs = [qk.quantize_int8_reference(_x(rows, seed)) for seed in range(replicas)]
    q = jnp.stack([a for a, _ in qs])
    s = jnp.stack([b for _, b in qs])
    got = qk.dequantize_mean_int8(q, s, implementation="interpret", block_sizes=BLOCK)
    np.testing.assert_allclose(got, qk.dequantize_mean_int8_reference(q, s), rtol=1e-5, atol=1e-5)


def test_the_int8_codec_collective_uses_the_kernel_path():
    """the int8 codec (block=128): all_gather_compressed decodes and averages through
    dequantize_mean_int8 (here in the interpreter) with the same result as the reference."""
    from co2jax import comm as cx

    payload = jnp.asarray(np.random.default_rng(0).normal(size=(4, 300)), jnp.float32)
    outs = {}
    for impl in ("xla", "interpret"):
        reduce = cx.all_gather_compressed(cx.int8(128, implementation=impl))
        outs[impl] = jax.vmap(reduce, axis_name="replica")(payload)
    text = str(
        jax.make_jaxpr(
            jax.vmap(
                cx.all_gather_compressed(cx.int8(128, implementation="interpret")),
                axis_name="replica",
            )
        )(payload)
    )
    assert "co2jax_dequantize_mean_int8" in text
    np.testing.assert_allclose(outs["interpret"], outs["xla"], rtol=1e-5, atol=1e-6)


def test_triton_lowering_without_a_gpu():
    from jax import export

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    q = jax.ShapeDtypeStruct((4, 64, 128), jnp.int8)
    s = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for fn, args in [
        (
            lambda x: qk.quantize_int8(
                x, implementation="pallas", backend="gpu", block_sizes=BLOCK
            ),
            (x,),
        ),
        (
            lambda q, s: qk.dequantize_mean_int8(
                q, s, implementation="pallas", backend="gpu", block_sizes=BLOCK
            ),
            (q, s),
        ),
    ]:
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*args)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_round_half_even_is_jnp_round():
    y = jnp.asarray([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 126.5, -126.5, 0.49, 3.7, -3.7, 0.0])
    np.testing.assert_array_equal(qk._round_half_even(y), jnp.round(y))


PACKED = ["fp4", "2bit"]


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("rows", [1, 83])
@pytest.mark.cases("each")
def test_quantize_packed_is_the_codec_encoding(fmt, rows):
    """Bit for bit the fp4(128) / two_bit(128)'s encoding (signs, zero rows)."""
    x = _x(rows)
    p, s = qk.quantize_packed(x, fmt, implementation="interpret", block_sizes=BLOCK)
    wp, ws = qk.quantize_packed_reference(x, fmt)
    assert p.dtype == jnp.uint8 and p.shape == (rows, 128 * qk.PACKED_BITS[fmt] // 8)
    np.testing.assert_array_equal(p, wp)
    np.testing.assert_array_equal(s, ws)


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.cases("each")
def test_dequantize_mean_packed_matches_reference(fmt, replicas):
    enc = [qk.quantize_packed_reference(_x(83, seed), fmt) for seed in range(replicas)]
    p = jnp.stack([a for a, _ in enc])
    s = jnp.stack([b for _, b in enc])
    got = qk.dequantize_mean_packed(p, s, fmt, implementation="interpret", block_sizes=BLOCK)
    want = qk.dequantize_mean_packed_reference(p, s, fmt)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # and the reference is the mean of the decoded payloads, element for element
    from co2jax import comm as cx

    codec = {"fp4": cx.fp4, "2bit": cx.two_bit}[fmt](128, implementation="xla")
    one = codec.decode(enc[0], 83 * 128).reshape(83, 128)
    if replicas == 1:
        np.testing.assert_array_equal(got, one)


@pytest.mark.parametrize("name", ["int8", "fp4", "2bit"])
@pytest.mark.parametrize("collective", ["all_gather_compressed", "all_reduce_compressed"])
@pytest.mark.cases("each")
def test_codec_collectives_run_the_kernels(name, collective):
    """block=128 codecs encode and decode-average through the kernels (interpreter) inside
    both compressed collectives, with the reference path's result."""
    from co2jax import comm as cx

    payload = jnp.asarray(np.random.default_rng(0).normal(size=(4, 1000)), jnp.float32)
    outs, texts = {}, {}
    for impl in ("xla", "interpret"):
        reduce = getattr(cx, collective)(cx.make(name, block=128, implementation=impl))
        fn = jax.vmap(reduce, axis_name="replica")
        outs[impl] = jax.jit(fn)(payload)
        texts[impl] = str(jax.make_jaxpr(fn)(payload))
    kernels = {"int8": "int8", "fp4": "fp4", "2bit": "2bit"}[name]
    assert f"co2jax_quantize_{kernels}" in texts["interpret"]
    assert f"co2jax_dequantize_mean_{kernels}" in texts["interpret"]
    assert "co2jax_" not in texts["xla"]
    np.testing.assert_allclose(outs["interpret"], outs["xla"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", PACKED)
def test_packed_triton_lowering_without_a_gpu(fmt):
    from jax import export

    width = 128 * qk.PACKED_BITS[fmt] // 8
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    p = jax.ShapeDtypeStruct((4, 64, width), jnp.uint8)
    s = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for fn, args in [
        (
            lambda x: qk.quantize_packed(
                x, fmt, implementation="pallas", backend="gpu", block_sizes=BLOCK
            ),
            (x,),
        ),
        (
            lambda p, s: qk.dequantize_mean_packed(
                p, s, fmt, implementation="pallas", backend="gpu", block_sizes=BLOCK
            ),
            (p, s),
        ),
    ]:
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*args)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()
