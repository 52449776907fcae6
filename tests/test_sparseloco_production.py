"""SparseLoCo's production mode against a numpy port of the released quantizer and aggregation
(``textbook_sparseloco``), under vmap and shard_map; its wire format and error feedback."""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_sparseloco as tq
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax.comm import all_gather_topk_quantized, quantize_values
from co2jax.comm.sparse_quant import tiling

LR, H, ROUNDS = 0.1, 3, 5
TOL = harness.TOL[jnp.dtype(jnp.float32)]
DIM = 66  # leaves "b" (2 elements: one dense chunk) and "w" (64: 4 chunks of 16, the top 4)
SETTING = dict(k=4, chunk=16)
SCALES = (0.3, 1.0, 3.0, 10.0)  # replicas' optima far apart in size: the median clip binds


@pytest.fixture(scope="module")
def problem():
    p = tb.make_problem(replicas=4, examples=2, dim=DIM, seed=7)
    return tb.Problem(p.d, p.c * np.asarray(SCALES)[:, None, None], p.theta0)


def _outer(**kw):
    return co2jax.sparseloco(mode="production", **{**SETTING, **kw})


def _textbook(problem, average="contributors", **kw):
    s = {**SETTING, **kw}
    return tq.sparseloco_production(
        problem, LR, H, ROUNDS, 1.0, 0.95, s["k"], s.get("tile", (64, 64)), s["chunk"], average
    )


# ---------------------------------------------------------------------------------------------
# the quantizer and the codec, value by value

RNG = np.random.default_rng(0)
VALUES = {
    "n2": RNG.normal(size=2),
    "n7": RNG.normal(size=7),
    "n1000": RNG.standard_t(3, size=1000),  # heavy tails: both outer bins used
    "n4097": RNG.normal(size=4097) + 0.5,
    "empty_bin": np.array([-3.0, -1.0, 1.0, 3.0]),  # nothing below -2.25 sigma: bin 0 empty
    # sigma 0: the scale falls back to 1. A constant whose float32 mean is exact in any
    # summation order: for 0.3 the mean's last bit decides whether sigma is 0 or 1e-8 (the
    # codes then differ, the decoded values do not), in the released code too
    "constant": np.full(10, -0.5),
    "one": np.array([1.7]),  # n = 1: sigma is 0/0, the scale falls back to 1
}


@pytest.mark.parametrize("name", list(VALUES))
@pytest.mark.cases("first", 3)
def test_quantizer_matches_textbook(name):
    v = VALUES[name].astype(np.float32)
    codes, shift, scale, lookup = (np.asarray(a) for a in quantize_values(jnp.asarray(v)))
    want_codes, want_shift, want_scale, want_lookup = tq.quantize(v)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_allclose(shift, want_shift, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    np.testing.assert_allclose(lookup, want_lookup, rtol=1e-6, atol=1e-7)
    decoded = np.asarray(co2jax.comm.dequantize_values(jnp.asarray(codes), shift, lookup))
    np.testing.assert_allclose(decoded, tq.dequantize(want_codes, want_shift, want_lookup), 1e-6)
    if name == "empty_bin":
        assert 0 not in codes and lookup[0] == 0
    if name in ("constant", "one"):
        assert scale == 1.0
        np.testing.assert_allclose(decoded, v, rtol=1e-6)
    if name == "n1000":
        assert set(codes.tolist()) == {0, 1, 2, 3}


SHAPES = {
    "scalar": (),
    "vector": (1000,),  # one chunk (1000 <= 4096)
    "ragged_vector": (4097 * 2,),  # 8194 = 2 * 17 * 241: chunks of 482
    "tiled": (64, 128),  # two 64x64 tiles: indices up to 4095, all 12 bits used
    "not_multiple": (96, 200),  # tiles of 48x50
    "prime_rows": (97, 64),  # tiles of 1x64: k = the chunk
    "three_axes": (3, 4, 10),  # viewed as 3x40: one tile of 120
}


# the default suite keeps a tiled matrix, a tiling with ragged tiles and a chunked vector; the
# rest run with -m slow (the suite's 15-minute budget)
_QUICK = ("ragged_vector", "tiled", "not_multiple")


@pytest.mark.parametrize(
    "name",
    [n if n in _QUICK else pytest.param(n, marks=pytest.mark.slow) for n in SHAPES],
)
@pytest.mark.cases("first", 1)
def test_codec_roundtrip_matches_textbook(name):
    shape = SHAPES[name]
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    reduce = all_gather_topk_quantized()
    decoded = np.asarray(reduce.encode({"x": jnp.asarray(x)}).decode()["x"])
    want = tq.decompress(tq.compress(x, 64), shape)
    np.testing.assert_allclose(decoded, want, rtol=1e-6, atol=1e-6)
    t = tiling(shape)
    assert (t.tile, t.k) == (tq.tiles_of(shape, (64, 64), 4096)[1], tq.kept_per_chunk(64, t.chunk))


def _replica_payloads(replicas=4, seed=2):
    rng = np.random.default_rng(seed)
    scales = np.array([0.1, 1.0, 2.0, 30.0])[:replicas, None]
    return {
        "a": (rng.normal(size=(replicas, 96 * 200)) * scales).reshape(replicas, 96, 200),
        "b": rng.normal(size=(replicas, 50)) * scales[::-1],
    }


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("average", ["contributors", "replicas"])
@pytest.mark.cases("first", 2)
def test_aggregate_matches_textbook(average, clip):
    x = jax.tree.map(lambda a: a.astype(np.float32), _replica_payloads())
    # "a": tiles of 48x50, the top 64; "b": chunks of 25, the top 24 (k clamped to even)
    reduce = all_gather_topk_quantized(average=average, clip=clip, chunk=25)
    got = jax.jit(jax.vmap(reduce, axis_name="replica"))(x)
    for key in x:
        encs = [tq.compress(x[key][r], 64, chunk=25) for r in range(4)]
        want = tq.aggregate(encs, x[key].shape[1:], chunk=25, average=average, clip=clip)
        # a decoded value is lookup + shift, which nearly cancel for a value near 0: float32
        # sums in another order move it by an ulp of the largest values, not of its own
        atol = 1e-6 * np.abs(want).max()
        for r in range(4):  # every replica holds the same aggregate
            np.testing.assert_allclose(np.asarray(got[key][r]), want, rtol=1e-5, atol=atol)


def test_separate_jobs_equal_the_collective():
    """Each replica encodes on its own (a job), the encodings are stacked and combined: the
    gather form gives what the in-program all-gather gives."""
    x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _replica_payloads())
    reduce = all_gather_topk_quantized(chunk=16)
    encode, combine = jax.jit(reduce.encode), jax.jit(lambda e: e.combine())
    encodings = [encode(jax.tree.map(lambda a, r=r: a[r], x)) for r in range(4)]
    got = combine(jax.tree.map(lambda *e: jnp.stack(e), *encodings))
    want = jax.jit(jax.vmap(reduce, axis_name="replica"))(x)
    for key in x:
        # equal up to float32 rounding: the two programs fuse the same sums differently
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key][0]), **TOL)


# ---------------------------------------------------------------------------------------------
# the loop against the textbook


def test_the_setting_is_not_degenerate(problem):
    """k < chunk in "w", and the median clip binds hard in the first round (the lower
    median's replica and any below it keep their values, the others are scaled down)."""
    t = tiling((DIM - 2,), **SETTING)
    assert t.k < t.chunk and t.chunks > 1
    deltas = [problem.theta0 - tb.inner_sgd(problem, r, problem.theta0, LR, H) for r in range(4)]
    norms = []
    for d in deltas:
        values = tq.sent_values(tq.compress(d[2:], SETTING["k"], chunk=SETTING["chunk"]))
        norms.append(math.sqrt(sum(float(np.sum(v * v)) for v in values)))
    factors = tq.clip_factors(norms)
    assert min(factors) < 0.2 and max(factors) == 1.0
    s = SETTING
    unclipped = tq.sparseloco_production(
        problem, LR, H, ROUNDS, 1.0, 0.95, s["k"], (64, 64), s["chunk"], clip=False
    )
    assert np.abs(_textbook(problem) - unclipped).max() > 0.1  # the loop feels the clip


@pytest.mark.parametrize("average", ["contributors", "replicas"])
# shard_map: the registry matrix runs sparseloco[production] there too (tests/test_matrix.py);
# here with -m slow (the suite's 15-minute budget)
@pytest.mark.parametrize("runner", ["vmap", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_loop_matches_textbook(runner, average, problem):
    outer = _outer(average=average)
    if runner == "vmap":
        got, state = harness.run_vmap(outer, problem, LR, H, ROUNDS)
    else:
        mesh = harness.make_mesh(replica=4, data=2)
        got, state = harness.run_shard_map(outer, problem, LR, H, ROUNDS, mesh)
    np.testing.assert_allclose(got, _textbook(problem, average), **TOL)
    assert (np.abs(np.asarray(state.residuals[0]["w"])).max(axis=-1) > 0).all()


def test_loop_with_tiled_matrix_matches_textbook():
    """A 2-D leaf of 6x10 with tiles of at most 4x4: 3x2 tiles (divisors, no padding), the top
    2 of each 6, under vmap (the shared runners hold 1-D leaves)."""
    shapes, kw = ((2,), (6, 10)), dict(k=2, chunk=16, tile=(4, 4))
    base = tb.make_problem(replicas=4, examples=2, dim=62, seed=11)
    problem = tb.Problem(base.d, base.c * np.asarray(SCALES)[:, None, None], base.theta0)
    outer = _outer(**kw)

    def unflatten(theta):
        return {"b": theta[:2], "w": theta[2:].reshape(shapes[1])}

    def replica(params, state, d, c):
        def loss(p):
            theta = jnp.concatenate([p["b"], p["w"].reshape(-1)])
            return jnp.mean(0.5 * jnp.sum(d * (theta - c) ** 2, axis=-1))

        for _ in range(H):
            params = jax.tree.map(lambda x, g: x - LR * g, params, jax.grad(loss)(params))
        return outer.sync(params, state)

    params = jax.vmap(unflatten)(
        jnp.broadcast_to(jnp.asarray(problem.theta0, jnp.float32), (4, 62))
    )
    state = jax.vmap(outer.init)(params)
    round_fn = jax.jit(jax.vmap(replica, axis_name="replica"))
    got = []
    for _ in range(ROUNDS):
        params, state = round_fn(params, state, jnp.asarray(problem.d), jnp.asarray(problem.c))
        flat = jnp.concatenate([params["b"], params["w"].reshape(4, -1)], axis=-1)
        got.append(np.asarray(flat, np.float64))
    want = tq.sparseloco_production(
        problem, LR, H, ROUNDS, 1.0, 0.95, kw["k"], kw["tile"], kw["chunk"], shapes=shapes
    )
    np.testing.assert_allclose(np.stack(got), want, **TOL)


def test_one_all_gather_per_round_and_no_all_reduce(problem):
    mesh = harness.make_mesh(replica=4, data=2)
    outer, inner = _outer(), optax.sgd(LR)
    params = harness.initial_params(problem)
    state = jax.vmap(outer.init)(params)
    inner_state = jax.vmap(inner.init)(params)
    rep = P("replica")
    args = [harness.place(x, mesh, rep) for x in (params, inner_state, state)]
    args += [
        harness.place(jnp.asarray(problem.d, jnp.float32), mesh, rep),
        harness.place(jnp.asarray(problem.c, jnp.float32), mesh, P("replica", "data")),
    ]
    hlo = harness.shard_round(outer, inner, mesh, H).lower(*args).compile().as_text()
    assert harness.count_replica_collectives(hlo, mesh, "all-gather") == 1  # one uint8 buffer
    assert harness.count_replica_collectives(hlo, mesh, "all-reduce") == 0


# ---------------------------------------------------------------------------------------------
# error feedback, the mean, the bytes, the arguments


def test_residual_is_target_minus_dequantized_sent():
    outer = _outer()
    rng = np.random.default_rng(4)
    anchor = {"b": jnp.zeros((4, 2)), "w": jnp.zeros((4, 64))}
    state = jax.vmap(outer.init)(anchor)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), anchor)
    _, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(params, state)
    roundtrip = jax.jit(lambda t: outer.reducer.encode(t).decode())
    for r in range(4):
        target = jax.tree.map(lambda a, p, r=r: a[r] - p[r], anchor, params)  # e = 0 before
        sent = roundtrip(target)
        residual = jax.tree.map(lambda e, r=r: e[r], state.residuals[0])
        for key in target:
            want = np.asarray(target[key] - sent[key])
            np.testing.assert_allclose(np.asarray(residual[key]), want, rtol=1e-6, atol=1e-7)
        assert np.count_nonzero(np.asarray(residual["w"])) >= 64 - 4 * 4  # 16 of 64 sent
        # "b" sends both values, which land in one bin (c = +-d, delta = 2.1 d): their mean
        b = np.asarray(target["b"])
        np.testing.assert_allclose(np.asarray(residual["b"]), b - b.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_mean_over_contributors_differs_from_one_over_r_where_it_should():
    """Where all R replicas selected an index the two means agree; where only some did the
    mean over contributors is R / count times the other; where none did both are 0."""
    x = _replica_payloads()["b"][:, :48].astype(np.float32)
    x[:, 0::16] += 50.0  # the first index of every chunk: selected by every replica
    got = {}
    for average in ("contributors", "replicas"):
        reduce = all_gather_topk_quantized(4, chunk=16, average=average)
        got[average] = np.asarray(jax.vmap(reduce, axis_name="replica")(jnp.asarray(x))[0])
    count = np.zeros(48)
    for r in range(4):
        for ch, idx in enumerate(tq.compress(x[r], 4, chunk=16)[0]):
            count[ch * 16 + idx] += 1
    every, some, none = count == 4, (count > 0) & (count < 4), count == 0
    assert every.any() and some.any() and none.any()
    np.testing.assert_allclose(got["contributors"][every], got["replicas"][every], rtol=1e-6)
    scaled = got["contributors"][some] * count[some] / 4
    np.testing.assert_allclose(scaled, got["replicas"][some], rtol=1e-5, atol=1e-7)
    assert np.abs(got["contributors"][some]).max() > 0.1  # so the two differ there
    assert not got["contributors"][none].any() and not got["replicas"][none].any()


def _payload_bytes(encoded) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in encoded.data)


def test_wire_bytes_of_a_large_matrix():
    """0.219 bits per parameter of a 4096x4096 matrix at k = 64 per 64x64 tile (1.56%)."""
    reduce = all_gather_topk_quantized()
    shapes = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    encoded = jax.eval_shape(reduce.encode, shapes)
    nbytes = _payload_bytes(encoded)
    assert nbytes == reduce.wire_bytes(shapes, 2)  # an all-gather sends it to R - 1 peers
    values = 4096 * 64
    assert nbytes == values * 12 // 8 + values * 2 // 8 + 4 * 6  # indices, codes, metadata
    bits = 8 * nbytes / 4096**2
    print(f"bits per parameter: {bits:.4f}, {32 / bits:.1f}x below float32")
    assert bits == pytest.approx(0.22, abs=0.002) and 32 / bits == pytest.approx(146, abs=1)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_wire_bytes_are_the_encoding_bytes():
    reduce = all_gather_topk_quantized(4, chunk=16)
    x = {k: jnp.asarray(v[0], jnp.float32) for k, v in _replica_payloads().items()}
    x["s"] = jnp.ones(())  # one value: one index (padded to a pair), one code
    encoded = reduce.encode(x)
    assert all(a.dtype == jnp.uint8 for a in encoded.data)
    assert _payload_bytes(encoded) == reduce.wire_bytes(x, 2) == reduce.wire_bytes(x, 5) / 4
    n_a, n_b = 8 * 4, 5 * 4  # "a": 8 tiles of 48x50, "b": 5 chunks of 10; the top 4 of each
    assert reduce.wire_bytes(x, 2) == sum(
        24 + 3 * math.ceil(n / 2) + math.ceil(n / 4) for n in (n_a, n_b, 1)
    )


def test_a_data_sharded_leaf_is_refused():
    mesh = harness.make_mesh(replica=4, data=2)
    reduce = all_gather_topk_quantized(4, chunk=16)
    body = jax.shard_map(
        lambda x: reduce(x[0])[None],
        mesh=mesh,
        in_specs=P("replica", "data"),
        out_specs=P("replica", "data"),
    )
    x = harness.place(jnp.ones((4, 32)), mesh, P("replica", "data"))
    with pytest.raises(ValueError, match="'data'"):
        jax.jit(body)(x)


def test_ternary_stays_the_default():
    assert (
        co2jax.sparseloco().reducer.name
        == co2jax.comm.all_gather_topk(32, 4096, co2jax.comm.two_bit(32)).name
    )
    assert _outer().reducer.name.startswith("all_gather_topk_quantized")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="dense"), "mode='dense'"),
        (dict(average="median"), "average='median'"),
        (dict(tile=(32, 32)), "tile=\\(32, 32\\)"),
        (dict(clip=False), "clip=False"),
        (dict(mode="production", quantize=False), "quantize=False"),
        (dict(mode="production", k=3), "k=3"),
        (dict(mode="production", k=5000), "k=5000"),
        (dict(mode="production", chunk=8192), "chunk=8192"),
        (dict(mode="production", tile=(128, 64)), "tile=\\(128, 64\\)"),
        (dict(mode="production", tile=64), "tile=64"),
        (dict(mode="production", learning_rate=0.0), "learning_rate=0.0"),
        (dict(mode="production", decay=1.5), "decay=1.5"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.sparseloco(**kwargs)


def test_bad_reducer_arguments():
    with pytest.raises(ValueError, match="bins=3"):
        all_gather_topk_quantized(bins=3)
    with pytest.raises(ValueError, match="range_sigmas=-1"):
        all_gather_topk_quantized(range_sigmas=-1)
