"""Every reducer equals the replica mean, under vmap and under shard_map."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import reducers

TOL = harness.TOL[jnp.dtype(jnp.float32)]


def _payload(R, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(size=(R, 3, 5)), dtype),
        "b": jnp.asarray(rng.normal(size=(R, 7)), dtype),  # 22 elements: pads for R = 4
    }


@pytest.mark.parametrize("kind", reducers.KINDS)
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_vmap_equals_mean(kind, R):
    payload = _payload(R)
    got = jax.vmap(reducers.make(kind), axis_name="replica")(payload)
    for k in payload:
        want = np.broadcast_to(np.asarray(payload[k]).mean(0), payload[k].shape)
        np.testing.assert_allclose(got[k], want, **TOL)


@pytest.mark.parametrize("kind", reducers.KINDS)
def test_keeps_dtype(kind):
    payload = _payload(4, jnp.bfloat16)
    got = jax.vmap(reducers.make(kind), axis_name="replica")(payload)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))


@pytest.mark.parametrize("kind", reducers.KINDS)
def test_shard_map_equals_mean(kind):
    mesh = harness.make_mesh(replica=4, data=2)
    payload = harness.place(_payload(4), mesh, P("replica"))
    reduce = reducers.make(kind)
    fn = jax.jit(
        jax.shard_map(
            lambda p: jax.tree.map(lambda x: x[None], reduce(jax.tree.map(lambda x: x[0], p))),
            mesh=mesh,
            in_specs=P("replica"),
            out_specs=P("replica"),
        )
    )
    got = fn(payload)
    for k in payload:
        want = np.broadcast_to(np.asarray(payload[k]).mean(0), payload[k].shape)
        np.testing.assert_allclose(got[k], want, **TOL)
    hlo = fn.lower(payload).compile().as_text()
    ops = {c.op for c in co2jax.hlo.over_axis(co2jax.hlo.collectives(hlo), mesh, "replica")}
    expected = {"pmean": "all-reduce", "all_gather": "all-gather", "ring": None}[kind]
    if expected:
        assert expected in ops
    else:  # a ring of collective-permutes: pairs, not groups
        assert any(c.op == "collective-permute" for c in co2jax.hlo.collectives(hlo))
        assert "all-reduce" not in ops


@pytest.mark.parametrize("kind", reducers.KINDS)
def test_as_the_reduce_of_an_algorithm(kind):
    """Any reducer plugs into a factory and gives the same trajectory."""
    problem = tb.make_problem()
    outer = co2jax.co2(1.0, 0.5, reduce=reducers.make(kind))
    got, _ = harness.run_vmap(outer, problem, 0.1, 3, 4)
    np.testing.assert_allclose(got, tb.co2_paper(problem, 0.1, 3, 4, 1.0, 0.5), **TOL)


def test_unknown_kind():
    with pytest.raises(ValueError, match="reducer='tree'"):
        reducers.make("tree")


def test_wire_bytes():
    assert reducers.wire_bytes("pmean", 100, 4) == 150.0
    assert reducers.wire_bytes("ring", 100, 4) == 150.0
    assert reducers.wire_bytes("all_gather", 100, 4) == 300.0
    assert reducers.wire_bytes("pmean", 100, 1) == 0.0
