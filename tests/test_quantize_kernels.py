"""The int8 Pallas kernels against their references (interpreter), and their lowerings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from co2jax.kernels import BlockSizes, api
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
def test_dequantize_mean_matches_reference(replicas, rows):
    qs = [qk.quantize_int8_reference(_x(rows, seed)) for seed in range(replicas)]
    q = jnp.stack([a for a, _ in qs])
    s = jnp.stack([b for _, b in qs])
    got = qk.dequantize_mean_int8(q, s, implementation="interpret", block_sizes=BLOCK)
    np.testing.assert_allclose(got, qk.dequantize_mean_int8_reference(q, s), rtol=1e-5, atol=1e-5)


def test_the_int8_codec_collective_uses_the_kernel_path():
    """compression.int8(block=128): all_gather_compressed decodes and averages through
    dequantize_mean_int8 (here in the interpreter) with the same result as the reference."""
    from co2jax import compression as cx

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
    with api.target_backend("gpu"):
        for fn, args in [
            (lambda x: qk.quantize_int8(x, implementation="pallas", block_sizes=BLOCK), (x,)),
            (
                lambda q, s: qk.dequantize_mean_int8(
                    q, s, implementation="pallas", block_sizes=BLOCK
                ),
                (q, s),
            ),
        ]:
            exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(
                *args
            )
            assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_round_half_even_is_jnp_round():
    y = jnp.asarray([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 126.5, -126.5, 0.49, 3.7, -3.7, 0.0])
    np.testing.assert_array_equal(qk._round_half_even(y), jnp.round(y))
