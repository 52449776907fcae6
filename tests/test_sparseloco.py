"""SparseLoCo against its numpy textbook loop, under vmap and shard_map; its wire format."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb

import co2jax

LR, H, ROUNDS = 0.1, 3, 6
SETTINGS = {  # 5 parameters: chunks of 4 (the last one ragged)
    "quantized": dict(k=4, chunk=4, quantize=True),
    "float": dict(k=2, chunk=4, quantize=False),
}
# k < chunk with 2-bit values: some selected values quantize to zero (|v| < max/2), so the
# indices a replica selected differ from the nonzeros of what it decodes to
SPARSE = dict(k=4, chunk=16, quantize=True)


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2)


def _textbook(problem, s):
    return tb.sparseloco(problem, LR, H, ROUNDS, 1.0, 0.95, s["k"], s["chunk"], s["quantize"])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_vmap_matches_textbook(name, problem):
    s = SETTINGS[name]
    got, _ = harness.run_vmap(co2jax.sparseloco(1.0, 0.95, **s), problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, _textbook(problem, s), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_shard_map_matches_textbook(name, problem):
    s = SETTINGS[name]
    mesh = harness.make_mesh(replica=4, data=2)
    got, _ = harness.run_shard_map(co2jax.sparseloco(1.0, 0.95, **s), problem, LR, H, ROUNDS, mesh)
    np.testing.assert_allclose(got, _textbook(problem, s), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def wide():
    return tb.make_problem(replicas=4, examples=2, dim=32, seed=3)


@pytest.mark.parametrize("runner", ["vmap", "shard_map"])
def test_k_below_chunk_with_2bit_values_matches_textbook(runner, wide):
    """The mean at each index is over the replicas that selected it, zeros after 2-bit
    quantization included: the support travels with the payload (before the fix, the
    collective re-derived it from the decoded values, off by up to 20x here)."""
    outer = co2jax.sparseloco(1.0, 0.95, **SPARSE)
    if runner == "vmap":
        got, _ = harness.run_vmap(outer, wide, LR, H, ROUNDS)
    else:
        got, _ = harness.run_shard_map(outer, wide, LR, H, ROUNDS, harness.make_mesh(4, 2))
    want = tb.sparseloco(wide, LR, H, ROUNDS, 1.0, 0.95, SPARSE["k"], SPARSE["chunk"], True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_setting_has_selected_zeros(wide):
    """The case above is not degenerate: selected values that quantize to zero occur."""
    e = wide.theta0 - tb.inner_sgd(wide, 0, wide.theta0, LR, H)
    sent, support = tb._topk_ternary(e, SPARSE["k"], SPARSE["chunk"], True)
    assert ((support == 1) & (sent == 0)).any()


def test_mean_is_over_contributors():
    """An index only one replica selected gets that replica's value, not a quarter of it."""
    reduce = co2jax.comm.all_gather_topk(1, chunk=4, mean="contributors")
    x = jnp.zeros((4, 4)).at[0, 0].set(8.0).at[1, 1].set(2.0).at[2, 1].set(4.0).at[3, 3].set(-1)
    got = jax.vmap(reduce, axis_name="replica")(x)
    np.testing.assert_array_equal(got[0], [8.0, 3.0, 0.0, -1.0])
    plain = co2jax.comm.all_gather_topk(1, chunk=4, mean="replicas")
    np.testing.assert_array_equal(jax.vmap(plain, axis_name="replica")(x)[0], [2.0, 1.5, 0, -0.25])


def test_wire_bytes_are_sparse():
    n = 4096 * 64
    reduce = co2jax.comm.all_gather_topk(32, 4096, co2jax.comm.two_bit(32))
    sent = reduce.codec.wire_bytes(n)
    assert sent == 64 * (32 * 2 + 32 // 4 + 4)  # indices, 2-bit values, one scale per chunk
    assert 4 * n / sent > 200  # vs float32: the uint16 indices dominate


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 4"):
        co2jax.sparseloco(k=3)
    with pytest.raises(ValueError, match="decay"):
        co2jax.sparseloco(decay=1.5)
    with pytest.raises(ValueError, match="mean"):
        co2jax.comm.all_gather_topk(1, 4, mean="median")
