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
EXACT_BITS = ("pmean", "all_gather")  # an exact mean: bit for bit
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


def _spread(reducer, K, encoded=False, lanes=None, shards=1):
    def run(payload):
        if encoded:
            payload = reducer.encode(payload)
        plan = chunks.plan(payload, reducer, K, lanes, shards=shards)
        buffer, acc = chunks.split(plan, payload), chunks.zeros(plan)
        for c in range(K):
            acc = chunks.put(acc, c, chunks.reduce(plan, reducer, chunks.take(buffer, c)))
        return chunks.finish(plan, acc)

    return run


def _whole(reducer, encoded=False):
    return lambda p: reducer.reduce(reducer.encode(p) if encoded else p)


@pytest.mark.parametrize("K", [1, 2, 3, 7])
@pytest.mark.parametrize("name", list(REDUCERS) + list(CLOSE))
@pytest.mark.cases("first", 9)
def test_chunks_equal_the_whole(name, K):
    reducer = {**REDUCERS, **CLOSE}[name]()
    payload = _payload()
    want = jax.jit(jax.vmap(_whole(reducer), axis_name="replica"))(payload)
    got = jax.jit(jax.vmap(_spread(reducer, K), axis_name="replica"))(payload)
    for k in payload:
        if name in EXACT_BITS:
            np.testing.assert_array_equal(got[k], want[k])
        elif name in REDUCERS:
            # the same decoded values averaged, fused by XLA into differently shaped loops:
            # float32 roundings apart (an encoding's arrays travel packed in one buffer)
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("name", ["int8", "topk_2bit", "topk_float"])
@pytest.mark.cases("each")
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


def _rows_payload(R=4, seed=3, lanes=8):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.normal(size=(R, *shape)), jnp.float32)
    return {  # row-shaped leaves (last axis a multiple of lanes) and ragged ones, packed
        "w": n(3, 2 * lanes),
        "v": n(2, 5, lanes),
        "b": n(13),
        "s": n(),
        "m": n(3, 5),
        "h": jnp.asarray(rng.normal(size=(R, 4, lanes)), jnp.bfloat16),
    }


def _in_rows_and_whole(reducer, payload, K, lanes=8):
    """(spread in rows of ``lanes``, whole) reductions of ``payload``, shapes and dtypes
    checked alike."""
    plan = chunks.plan(jax.tree.map(lambda x: x[0], payload), reducer, K, lanes=lanes)
    assert plan.lanes == (lanes,) and plan.piece_shape(0) == (plan.units[0], lanes)
    want = jax.jit(jax.vmap(_whole(reducer), axis_name="replica"))(payload)
    got = jax.jit(jax.vmap(_spread(reducer, K, lanes=lanes), axis_name="replica"))(payload)
    for k in payload:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
    return got, want


@pytest.mark.parametrize("K", [1, 2, 3, 7])
@pytest.mark.parametrize("name", ["pmean", "all_gather", "ring"])
@pytest.mark.cases("first", 4)
def test_chunks_in_rows_equal_the_whole(name, K):
    """An exact reducer's chunks as ``[rows, lanes]`` blocks (lanes 8 here, 1024 by default):
    row-shaped leaves keep their rows, the rest is packed; the pieces reduce to the whole."""
    reducer = {**REDUCERS, **CLOSE}.get(name, lambda: comm.ring_mean())()
    payload = _rows_payload()
    got, want = _in_rows_and_whole(reducer, payload, K)
    for k in payload:
        if name == "ring":
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
        elif name == "pmean" and k == "h":
            # pmean reduces the whole bf16 leaf in bf16, its chunk in the group's common
            # dtype (float32): one bf16 rounding apart, the better one for the chunk
            np.testing.assert_allclose(got[k].astype(np.float32), want[k].astype(np.float32),
                                       rtol=2**-7, atol=2**-8)  # fmt: skip
        else:
            np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("name", ["int8", "fp4"])
@pytest.mark.cases("each")
def test_codec_chunks_in_rows_equal_the_whole(name, K):
    """A compressed reducer's chunks as rows of whole codec blocks (lanes 8, blocks of 8;
    1024 and 128 by default) where every leaf of the group is row-shaped: the blocks of a
    flat vector of the leaves, so the pieces reduce to the whole reduction."""
    reducer = REDUCERS[name]()
    rng = np.random.default_rng(4)
    n = lambda *shape: jnp.asarray(rng.normal(size=(3, *shape)), jnp.float32)
    payload = {"w": n(3, 16), "v": n(2, 5, 8), "h": n(7, 8).astype(jnp.bfloat16)}
    got, want = _in_rows_and_whole(reducer, payload, K)
    for k in payload:
        # the same decoded values averaged, fused into differently shaped loops
        np.testing.assert_allclose(
            np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("name", ["int8", "fp4"])
@pytest.mark.cases("first", 1)  # 20 s a case (the replica-mapped program); FP4 with -m slow
def test_codec_chunks_in_rows_split_over_data_equal_the_whole(name):
    """The rows of codec blocks as a round sends them: each chunk split over the replica's
    2 devices along ``data`` (R = 4, K = 3, rows not a multiple of K x 2), in the program
    mapped by hand over the replica axis only; the values equal the whole reduction."""
    import co2jax

    mesh = co2jax.make_mesh(replica=4, data=2)
    reducer = REDUCERS[name]()
    rng = np.random.default_rng(5)
    n = lambda *shape: jnp.asarray(rng.normal(size=(4, *shape)), jnp.float32)
    payload = {"w": n(5, 16), "v": n(3, 3, 8)}  # 19 rows of 8
    plan = chunks.plan(jax.tree.map(lambda x: x[0], payload), reducer, 3, lanes=8, shards=2)
    assert plan.lanes == (8,) and plan.units[0] % 2 == 0
    run = lambda fn: co2jax.replica_map(fn, mesh)(payload)
    want = run(_whole(reducer))
    got = run(_spread(reducer, 3, lanes=8, shards=2))
    for k in payload:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_rows_are_the_default_for_large_groups_only():
    big = {"w": jnp.zeros((64, 2 * chunks.LANES)), "b": jnp.zeros(37)}
    reducer = comm.all_gather_mean()
    assert chunks.plan(big, reducer, 2).lanes == (chunks.LANES,)
    assert chunks.plan(big, reducer, 3).lanes == (0,)  # under MIN_ROWS rows a chunk
    # a codec's blocks: flat where a leaf is not in rows ("b"), in rows where every one is
    assert chunks.plan(big, REDUCERS["int8"](), 2).lanes == (0,)
    assert chunks.plan({"w": big["w"]}, REDUCERS["int8"](), 2).lanes == (chunks.LANES,)
    with pytest.raises(ValueError, match="lanes=4"):  # blocks of 8 do not tile a row of 4
        chunks.plan(big, REDUCERS["int8"](), 2, lanes=4)
    two_step = CLOSE["two_step_int8"]()  # reduces a chunk in stages: flat
    assert chunks.plan({"w": big["w"]}, two_step, 2).lanes == (0,)


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
        if name in EXACT_BITS:
            np.testing.assert_array_equal(a, b)
        else:  # decoded values averaged in differently fused loops: roundings apart
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


STAGED = {
    "staged": (lambda: comm.exact_mean("staged"), comm.pmean),
    "staged_permutes": (lambda: comm.exact_mean("staged_permutes"), comm.pmean),
    # the two-step compressed all-reduce, in blocks of 4: its own whole reduction is the
    # twin (tests/test_two_step_feedback.py holds that one to the numpy loop)
    "two_step_int8": (lambda: comm.all_reduce_compressed(comm.int8(block=4)), None),
}


@pytest.mark.parametrize("name", list(STAGED))
@pytest.mark.parametrize("R,K", [(3, 1), (4, 3), (5, 4)])
@pytest.mark.cases("each")
def test_staged_pieces_over_one_step_more_equal_the_mean(R, K, name):
    """A staged reducer's K pieces over steps 0..K, every step alike (``reduce_chunk``: step
    c gathers piece c - 1 and scatters piece c; step 0 gathers a zero share, step K
    scatters piece K - 1 again, both unused), run in a loop as a round runs them: the
    buffer's result is the whole reduction's (the all-reduce's mean, a float32 rounding
    apart at most: XLA fuses the two differently; the two-step compressed all-reduce's,
    whose shares travel encoded), the same on every replica, and each step from 1 on hands
    back the piece it gathered as sent (step 0: zeros) and that piece's own reduction."""
    make, twin = STAGED[name]
    reducer = make()
    whole = (twin or make)()
    payload = _payload(R, seed=4)

    def run(p):
        plan = chunks.plan(p, reducer, chunks.pieces(reducer, K + 1))

        def step(buffer, c):
            buffer, piece, reduced = chunks.reduce_chunk(plan, reducer, buffer, c)
            return buffer, (piece, reduced)

        buffer = chunks.fill(plan, p, reducer=reducer)
        buffer, (sent, reduced) = jax.lax.scan(step, buffer, jnp.arange(K + 1))
        return chunks.result(plan, buffer), sent, reduced, chunks.split(plan, p)

    got, sent, reduced, cut = jax.jit(jax.vmap(run, axis_name="replica"))(payload)
    want = jax.jit(jax.vmap(_whole(whole), axis_name="replica"))(payload)
    for k in payload:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
        assert float(jnp.max(jnp.abs(got[k][0] - got[k][-1]))) == 0.0  # every replica alike
    each = lambda w: jnp.stack([whole.reduce(w[c]) for c in range(w.shape[0])])
    for s, r, w in zip(sent, reduced, cut, strict=True):  # [R, K + 1, ...], [R, K, ...]
        assert float(jnp.max(jnp.abs(s[:, 0]))) == 0.0
        np.testing.assert_array_equal(s[:, 1:], w)  # piece c - 1 as sent, at step c
        pieces = jax.jit(jax.vmap(each, axis_name="replica"))(w)
        np.testing.assert_allclose(r[:, 1:], pieces, rtol=1e-6, atol=1e-7)
    if twin is None:  # the second quantization is there: not the plain mean
        mean = {k: np.broadcast_to(np.mean(v, 0), v.shape) for k, v in payload.items()}
        assert max(float(np.max(np.abs(got[k] - mean[k]))) for k in payload) > 1e-3


def test_a_staged_transfer_spans_one_step_more_than_its_pieces():
    """K pieces over a transfer's K + 1 chunk steps, each step one scatter and one gather:
    the round's wire bytes are (K + 1) / K of the ring all-reduce's of the payload, where
    the all-gather sends R - 1 times it."""
    from co2jax.engines.program import wire_bytes
    from co2jax.protocol import Transfer

    staged, gathered = comm.exact_mean("staged"), comm.exact_mean("all_gather")
    assert chunks.pieces(staged, 4) == 3 and chunks.pieces(gathered, 4) == 4
    assert chunks.pieces(staged, 1) == 1  # one step: reduced whole
    shapes = [{"w": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)}]
    ring = comm.ring_bytes(4096 * 1024 * 2, 8)
    for slots in (4, 16):
        t = Transfer(0, 16, chunks=slots)
        got = wire_bytes((t,), shapes, (staged,), 8)
        # within 1%: 4096 rows cut into 15 pieces pad the last one to whole rows
        assert got == pytest.approx(ring * slots / (slots - 1), rel=0.01)
        assert wire_bytes((t,), shapes, (gathered,), 8) == pytest.approx(4 * ring, rel=1e-3)


def test_chunks_in_rows_are_whole_tiles_where_that_pads_little():
    """A chunk in rows holds whole TPU tiles (8 rows) per device, and per replica's share
    of them for a staged reducer, where that pads it by at most 1/64; else fewer
    constraints, down to whole rows per device. What the rows cost: at most 1/64 more."""
    from co2jax.comm.chunks import SUBLANES, _row_units

    assert SUBLANES == 8
    assert _row_units(32791, 4, 4) == 32896  # whole tiles per share: 128 | rows
    assert _row_units(32791, 4, 1) == 32800  # whole tiles per device
    assert _row_units(601, 1, 8) == 608  # 64 | rows would pad more than 1/64: 8 | rows
    assert _row_units(274, 1, 8) == 274  # either would: as it is
    assert _row_units(275, 2, 1) == 276  # whole rows per device
    for count in (1, 63, 511, 512, 4097, 32791, 98365):
        for shards in (1, 2, 4):
            for replicas in (1, 4, 16):
                rows = _row_units(count, shards, replicas)
                assert rows % shards == 0 and count <= rows
                assert rows - count < max(shards, count / 64), (count, shards, replicas)
    shapes = {"w": jax.ShapeDtypeStruct((12, 4096, 1024), jnp.bfloat16)}
    staged, gathered = comm.exact_mean("staged"), comm.exact_mean("all_gather")
    cut = chunks.plan(shapes, staged, 3, shards=4, replicas=4)
    assert cut.lanes == (1024,) and cut.units[0] % (4 * 4 * SUBLANES) == 0
    assert chunks.plan(shapes, gathered, 3, shards=4, replicas=4).units[0] % (4 * SUBLANES) == 0
