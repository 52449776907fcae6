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
from co2jax import comm
from co2jax.comm import packing

TOL = harness.TOL[jnp.dtype(jnp.float32)]


def _payload(R, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(size=(R, 3, 5)), dtype),
        "b": jnp.asarray(rng.normal(size=(R, 7)), dtype),  # 22 elements: pads for R = 4
    }


@pytest.mark.parametrize("kind", comm.EXACT)
@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.cases("first", 5)
def test_vmap_equals_mean(kind, R):
    payload = _payload(R)
    got = jax.vmap(comm.exact_mean(kind), axis_name="replica")(payload)
    for k in payload:
        want = np.broadcast_to(np.asarray(payload[k]).mean(0), payload[k].shape)
        np.testing.assert_allclose(got[k], want, **TOL)


@pytest.mark.parametrize("kind", comm.EXACT)
def test_keeps_dtype(kind):
    payload = _payload(4, jnp.bfloat16)
    got = jax.vmap(comm.exact_mean(kind), axis_name="replica")(payload)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))


@pytest.mark.parametrize("kind", comm.EXACT)
def test_shard_map_equals_mean(kind):
    mesh = harness.make_mesh(replica=4, data=2)
    payload = harness.place(_payload(4), mesh, P("replica"))
    reduce = comm.exact_mean(kind)
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
    expected = {"pmean": "all-reduce", "all_gather": "all-gather", "ring": None}.get(kind)
    if kind == "scatter_gather":  # the reduce-scatter as an all-to-all, then the all-gather
        assert {"all-to-all", "all-gather"} <= ops and "all-reduce" not in ops
    elif kind == "staged":  # the reduce-scatter as permutes (pairs), then the all-gather
        assert any(c.op == "collective-permute" for c in co2jax.hlo.collectives(hlo))
        assert "all-gather" in ops and not ops & {"all-reduce", "all-to-all"}
    elif kind == "staged_permutes":  # both stages as permutes: 2 (R - 1) of them
        permutes = [c for c in co2jax.hlo.collectives(hlo) if c.op == "collective-permute"]
        assert len(permutes) == 6 and not ops, (permutes, ops)
    elif expected:
        assert expected in ops
    else:  # a ring of collective-permutes: pairs, not groups
        assert any(c.op == "collective-permute" for c in co2jax.hlo.collectives(hlo))
        assert "all-reduce" not in ops


@pytest.mark.parametrize("kind", comm.EXACT)
def test_as_the_reduce_of_an_algorithm(kind):
    """Any reducer plugs into a factory and gives the same trajectory."""
    problem = tb.make_problem()
    outer = co2jax.co2(1.0, 0.5, reduce=comm.exact_mean(kind))
    got, _ = harness.run_vmap(outer, problem, 0.1, 3, 4)
    np.testing.assert_allclose(got, tb.co2_paper(problem, 0.1, 3, 4, 1.0, 0.5), **TOL)


def test_each_exact_mean_is_named_as_chosen():
    """The name a run records and an error quotes is the kind the user chose."""
    assert [comm.exact_mean(kind).name for kind in comm.EXACT] == list(comm.EXACT)


def test_unknown_kind():
    with pytest.raises(ValueError, match="reducer='tree'"):
        comm.exact_mean("tree")


def test_wire_bytes():
    """What each exact mean puts on the wire: the all-reduce and ring 2 (R-1)/R payloads (the
    ring in float32), the all-gather R-1 payloads in the leaves' common dtype."""
    f32 = {"a": jax.ShapeDtypeStruct((25,), jnp.float32)}
    bf16 = {"a": jax.ShapeDtypeStruct((25,), jnp.bfloat16)}
    assert comm.pmean().wire_bytes(f32, 4) == 150.0
    assert comm.ring_mean().wire_bytes(f32, 4) == 150.0
    assert comm.all_gather_mean().wire_bytes(f32, 4) == 300.0
    assert comm.pmean().wire_bytes(f32, 1) == 0.0
    assert comm.pmean().wire_bytes(bf16, 4) == 75.0
    assert comm.ring_mean().wire_bytes(bf16, 4) == 150.0  # summed and sent in float32
    assert comm.all_gather_mean().wire_bytes(bf16, 4) == 150.0  # gathered in bfloat16
    assert comm.exact_mean("staged").wire_bytes(bf16, 4) == 75.0  # the ring's, in bfloat16
    assert comm.exact_mean("staged_permutes").wire_bytes(bf16, 4) == 75.0


@pytest.mark.parametrize("R", [2, 3, 4, 8])
def test_the_exchange_by_permutes_is_the_all_to_all(R):
    """The staged mean's reduce-scatter sends piece j to replica j by R - 1 permutes:
    bit for bit what ``lax.all_to_all`` delivers, under vmap and over the replica axis of a
    mesh (R x 1 devices)."""
    from co2jax.comm.staged import exchange

    pieces = jnp.asarray(np.random.default_rng(R).normal(size=(R, R, 5)), jnp.float32)
    a2a = lambda q: jax.lax.all_to_all(q, "replica", 0, 0)
    for_vmap = lambda f: jax.jit(jax.vmap(f, axis_name="replica"))(pieces)
    want = np.asarray(for_vmap(a2a))
    np.testing.assert_array_equal(np.asarray(for_vmap(exchange)), want)
    mesh = harness.make_mesh(replica=R, data=1)
    on_mesh = lambda f: jax.jit(
        jax.shard_map(lambda q: f(q[0])[None], mesh=mesh, in_specs=P("replica"),
                      out_specs=P("replica"))
    )(harness.place(pieces, mesh, P("replica")))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(on_mesh(exchange)), want)


@pytest.mark.parametrize("R, n", [(3, 1), (4, 22), (8, 61)])
def test_staged_stages_apart_equal_the_mean(R, n):
    """The two stages run apart (the shard carried between them, as a round carries it
    from one step to the next) give the mean, for sizes that R does not divide."""
    x = jnp.asarray(np.random.default_rng(n).normal(size=(R, n)), jnp.float32)
    stages = comm.exact_mean("staged").stages
    shards = jax.jit(jax.vmap(lambda v: stages.scatter([v]), axis_name="replica"))(x)
    assert shards[0].shape == (R, -(-n // R))
    assert stages.empty(n, R, jax.ShapeDtypeStruct((n,), jnp.float32)).shape == (-(-n // R),)
    got = jax.jit(jax.vmap(lambda s: stages.gather(s, [n]), axis_name="replica"))(shards)
    np.testing.assert_allclose(got[0], np.broadcast_to(np.asarray(x).mean(0), x.shape), **TOL)


@pytest.mark.parametrize("kind", comm.EXACT)
def test_gather_form_equals_the_reduction(kind):
    """Every exact mean has a gather form (what separate jobs exchange): the stacked
    encodings combined equal the in-program reduction."""
    payload = _payload(4)
    reducer = comm.exact_mean(kind)
    encoded = jax.vmap(reducer.encode)(payload)
    combined = encoded.combine()
    got = jax.vmap(reducer, axis_name="replica")(payload)
    for k in payload:
        np.testing.assert_allclose(combined[k], got[k][0], **TOL)


def test_mixed_groups_are_gathered_apart():
    """Inside shard_map a data shard beside a whole leaf: each group of leaves with the same
    varying axes is gathered on its own, so the whole leaf stays data-invariant (the round
    would otherwise not build under check_vma)."""
    mesh = harness.make_mesh(replica=4, data=2)
    x = harness.place(jnp.arange(16.0).reshape(4, 4), mesh, P("replica", "data"))
    w = harness.place(jnp.arange(12.0).reshape(4, 3), mesh, P("replica"))
    for reducer in (comm.all_gather_mean(), comm.ring_mean()):

        def body(x, w, reducer=reducer):
            out = reducer({"x": x[0], "w": w[0]})
            return out["x"][None], out["w"][None]

        fn = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("replica", "data"), P("replica")),
                out_specs=(P("replica", "data"), P("replica")),
            )
        )
        gx, gw = fn(x, w)
        np.testing.assert_allclose(
            gx, np.broadcast_to(np.arange(16.0).reshape(4, 4).mean(0), (4, 4))
        )
        np.testing.assert_allclose(
            gw, np.broadcast_to(np.arange(12.0).reshape(4, 3).mean(0), (4, 3))
        )


@pytest.mark.parametrize(
    "leaves",
    [
        # (dtype, one row's shape): whole words along the rows (int8: 4, bf16: 2 a word),
        # along the last axis, through the bytes, 4-byte elements as they are
        [("int8", (8, 128)), ("float32", (8,))],
        [("int8", (3, 8)), ("bfloat16", (6, 10)), ("int8", (3, 5)), ("bool", (4, 4))],
        [("uint8", (7,)), ("float32", (33,)), ("int32", (2, 3)), ("bfloat16", (5,))],
        # a buffer of 100 rows of 128 words or more: each leaf starts on a row
        [("int8", (512, 128)), ("float32", (512,)), ("uint8", (3,))],
    ],
    ids=["encoding", "small_types", "odd", "in_rows"],
)
def test_packed_rows_unpack_to_the_same_bits(leaves):
    """pack_rows then unpack_rows gives every leaf back bit for bit, for 3 rows of each."""
    rng = np.random.default_rng(1)
    arrays = [jnp.asarray(rng.normal(size=(3, *shape)) * 100).astype(dt) for dt, shape in leaves]
    words = packing.pack_rows(arrays)
    assert words.dtype == jnp.uint32 and words.shape[0] == 3
    likes = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in arrays]
    for got, want in zip(packing.unpack_rows(words, likes), arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if words.shape[-1] == 128:  # int8 codes 4 rows a word: 128 rows; scales 4 rows; 1 row
        assert words.shape == (3, 128 + 4 + 1, 128)


@pytest.mark.parametrize("dtypes", [("int8", "float32"), ("bfloat16", "int32", "bool", "uint8")])
def test_packed_gather_equals_gathering_leaf_by_leaf(dtypes):
    """One collective for an encoding's arrays (bit cast to bytes) gives exactly what a
    collective per array gives, shapes that do not divide included."""
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (2, 1, 3), (1,)]
    tree = {
        f"{dt}{i}": jnp.asarray(rng.normal(size=(4, *shapes[i])) * 100).astype(dt)
        for i, dt in enumerate(dtypes)
    }
    gather = lambda packed: jax.vmap(
        lambda t: comm.all_gather_tree(t, "replica", packed=packed), axis_name="replica"
    )(tree)
    packed, plain = gather(True), gather(False)
    for k in tree:
        assert packed[k].dtype == plain[k].dtype and packed[k].shape == (4, 4, *tree[k].shape[1:])
        np.testing.assert_array_equal(np.asarray(packed[k]), np.asarray(plain[k]))
    mesh = co2jax.make_mesh(replica=4, data=1, devices=jax.devices("cpu")[:4])
    for packed, want in ((True, 1), (False, len(tree))):
        fn = co2jax.replica_map(lambda t, p=packed: comm.all_gather_tree(t, "replica", p), mesh)
        assert co2jax.axes.collectives_in(jax.make_jaxpr(fn)(tree).jaxpr, "replica") == want
