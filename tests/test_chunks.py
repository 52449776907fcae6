"""A payload reduced chunk by chunk equals the whole reduction (co2jax.comm.chunks)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from co2jax import comm
from co2jax.comm import chunks

REDUCERS = {
    "pmean": lambda: comm.pmean(),
    "all_gather": lambda: comm.all_gather_mean(),
    "int8": lambda: comm.all_gather_compressed(comm.int8(block=8)),
    "fp4": lambda: comm.all_gather_compressed(comm.fp4(block=8)),
    "topk_2bit": lambda: comm.all_gather_topk(4, chunk=16, values=comm.two_bit(block=4)),
    "topk_float": lambda: comm.all_gather_topk(3, chunk=10),
}
CLOSE = {  # summed in another order / shards re-quantized per piece: close, not equal
    "ring": lambda: comm.ring_mean(),
    "two_step_int8": lambda: comm.all_reduce_compressed(comm.int8(block=8)),
}


def _payload(R=4, seed=0):
    rng = np.random.default_rng(seed)
    return {  # 37 + 6 elements: ragged against every block and chunk count
        "a": jnp.asarray(rng.normal(size=(R, 37)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(R, 2, 3)), jnp.float32),
    }


def _spread(reducer, K, encoded=False):
    def run(payload):
        if encoded:
            payload = reducer.encode(payload)
        plan = chunks.plan(payload, reducer, K)
        buffer, acc = chunks.split(plan, payload), chunks.zeros(plan)
        for c in range(K):
            acc = chunks.put(acc, c, chunks.reduce(plan, reducer, chunks.take(buffer, c)))
        return chunks.finish(plan, acc)

    return run


def _whole(reducer, encoded=False):
    return lambda p: reducer.reduce(reducer.encode(p) if encoded else p)


@pytest.mark.parametrize("K", [1, 2, 3, 7])
@pytest.mark.parametrize("name", list(REDUCERS) + list(CLOSE))
def test_chunks_equal_the_whole(name, K):
    reducer = {**REDUCERS, **CLOSE}[name]()
    payload = _payload()
    want = jax.jit(jax.vmap(_whole(reducer), axis_name="replica"))(payload)
    got = jax.jit(jax.vmap(_spread(reducer, K), axis_name="replica"))(payload)
    for k in payload:
        if name in REDUCERS:
            np.testing.assert_array_equal(got[k], want[k])
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("name", ["int8", "topk_2bit", "topk_float"])
def test_encoded_chunks_equal_the_whole(name, K):
    """What error feedback sends (the encoding itself), cut along its blocks."""
    reducer = REDUCERS[name]()
    payload = _payload(seed=1)
    want = jax.jit(jax.vmap(_whole(reducer, True), axis_name="replica"))(payload)
    got = jax.jit(jax.vmap(_spread(reducer, K, True), axis_name="replica"))(payload)
    for k in payload:
        # the same per-element arithmetic, fused by XLA into differently shaped loops: a
        # float32 rounding apart (at most one ulp, seen here), not a different reduction
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_chunk_cuts_respect_the_codec_block():
    plan = chunks.plan({"a": jnp.zeros(37)}, REDUCERS["int8"](), 3)
    assert plan.elements(0) % 8 == 0 and 3 * plan.elements(0) >= 37
    plan = chunks.plan({"a": jnp.zeros(37)}, REDUCERS["topk_2bit"](), 2)
    assert plan.elements(0) % 16 == 0


@pytest.mark.parametrize("name", ["all_gather", "int8"])
def test_chunks_of_mixed_groups_under_shard_map(name):
    """A data shard beside a whole leaf: each group cut and reduced on its own, the whole
    leaf stays data-invariant (check_vma on), values equal the whole reduction."""
    mesh = harness.make_mesh(replica=4, data=2)
    reducer = REDUCERS[name]()
    rng = np.random.default_rng(2)
    x = harness.place(
        jnp.asarray(rng.normal(size=(4, 16)), jnp.float32), mesh, P("replica", "data")
    )
    w = harness.place(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), mesh, P("replica"))

    def body(fn):
        def inner(x, w):
            out = fn({"x": x[0], "w": w[0]})
            return out["x"][None], out["w"][None]

        return jax.jit(
            jax.shard_map(
                inner,
                mesh=mesh,
                in_specs=(P("replica", "data"), P("replica")),
                out_specs=(P("replica", "data"), P("replica")),
            )
        )

    want = body(_whole(reducer))(x, w)
    got = body(_spread(reducer, 3))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
