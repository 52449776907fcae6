"""Compression codecs, the compressed collective and error feedback."""

from __future__ import annotations

import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax import comm as cx
from co2jax.comm.compressed import shard_size

CODECS = {
    "none": cx.none(),
    "bf16": cx.bf16(),
    "fp8": cx.fp8(block=64),
    "int8": cx.int8(block=64),
    "fp4": cx.fp4(block=64),
    "2bit": cx.two_bit(block=64),
    "topk": cx.topk(8, chunk=64),
    "topk_2bit": cx.topk(8, chunk=64, values=cx.two_bit(block=8)),
}
SIZES = [1, 63, 64, 1000]  # ragged: shorter than, equal to and not a multiple of a block


def _step_bound(name, x):
    """Largest allowed |x - roundtrip(x)| per element, from each format's quantization step."""
    xb = np.pad(np.abs(x), (0, (-x.size) % 64)).reshape(-1, 64)
    s = np.repeat(xb.max(axis=1), 64)[: x.size]  # the block's max|x|
    a = np.abs(x)
    return {
        "none": np.zeros_like(a),
        "bf16": a * 2.0**-8,
        "fp8": a * 2.0**-4 + s / 448 * 2.0**-9,  # 3 mantissa bits; subnormals
        "int8": s / 127 / 2,
        "fp4": np.maximum(a / 3, s * 2.0**-7),
        "2bit": s / 2,
    }.get(name)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.cases("first", 8)
def test_roundtrip_within_the_quantization_step(name, n):
    codec = CODECS[name]
    rng = np.random.default_rng(n)
    x = (rng.normal(size=n) * rng.choice([1e-3, 1.0, 50.0], size=n)).astype(np.float32)
    x[:: max(1, n // 5)] = 0.0  # zeros inside blocks
    got = np.asarray(jax.jit(codec.roundtrip)(jnp.asarray(x)))
    assert got.shape == (n,) and got.dtype == np.float32
    np.testing.assert_array_equal(got[x == 0], 0.0)  # zeros exact
    assert np.all(np.sign(got[got != 0]) == np.sign(x[got != 0]))  # signs kept
    bound = _step_bound(name, x)
    if bound is not None:
        np.testing.assert_array_less(np.abs(got - x), bound + 1e-12)
    else:  # top-k: the k largest of each chunk are kept (exactly, or within their codec)
        kept = got != 0
        for c in range(0, n, 64):
            xs, ks = np.abs(x[c : c + 64]), kept[c : c + 64]
            if ks.any() and (~ks).any():
                assert xs[ks].min() >= xs[~ks].max()
        if name == "topk":
            np.testing.assert_array_equal(got[kept], x[kept])


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.cases("first", 5)
def test_idempotent(name):
    """C(D(C(x))) == C(x): error feedback's sent value crosses the collective unchanged."""
    codec = CODECS[name]
    x = jnp.asarray(np.random.default_rng(0).normal(size=300), jnp.float32)
    once = codec.roundtrip(x)
    # exact for the integer formats; to float32 rounding where a scale divides and multiplies
    np.testing.assert_allclose(codec.roundtrip(once), once, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.cases("first", 4)
def test_all_zero_and_non_finite_blocks(name):
    codec = CODECS[name]
    np.testing.assert_array_equal(codec.roundtrip(jnp.zeros(130)), 0.0)
    x = jnp.ones(128).at[3].set(jnp.nan)
    got = np.asarray(codec.roundtrip(x))
    assert not np.isfinite(got).all(), "a NaN must not disappear"


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_wire_bytes_are_the_encoded_bytes():
    for name, codec in CODECS.items():
        for n in SIZES:
            enc = codec.encode(jnp.ones(n))
            size = sum(e.size * e.dtype.itemsize for e in jax.tree.leaves(enc))
            assert codec.wire_bytes(n) == size, (name, n)
    n = 2**20
    assert cx.fp4(128).wire_bytes(n) / (4 * n) == pytest.approx((64 + 4) / 512)  # ~7.5x
    sparse = cx.topk(32, 4096, cx.two_bit(32))
    assert 4 * n / sparse.wire_bytes(n) > 150  # 0.8% density, 2-bit values + indices


@pytest.mark.parametrize("name", ["int8", "fp4", "topk_2bit"])
@pytest.mark.cases("first", 2)
def test_compressed_collective_is_the_mean_of_the_decoded_payloads(name):
    codec = CODECS[name]
    rng = np.random.default_rng(1)
    payload = {"a": jnp.asarray(rng.normal(size=(4, 70)), jnp.float32), "b": jnp.ones((4, 3))}
    got = jax.vmap(cx.all_gather_compressed(codec), axis_name="replica")(payload)
    decoded = jax.vmap(lambda p: _roundtrip_tree(codec, p))(payload)
    want = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), decoded)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7), got, want)


def _roundtrip_tree(codec, tree):
    """The slow twin: every leaf flattened into one vector, roundtripped, split back."""
    leaves, treedef = jax.tree.flatten(tree)
    flat = codec.roundtrip(jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves]))
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return jax.tree.unflatten(treedef, out)


def test_compressed_collective_moves_the_compressed_dtype(tmp_path):
    """In compiled HLO the replica all-gather carries int8 values and float32 scales only, as
    the bytes of one buffer (32-bit words): one collective, the codec's bytes."""
    mesh = harness.make_mesh(replica=4, data=2)
    codec = cx.int8(block=128)
    outer = co2jax.diloco(optax.sgd(0.7), reduce=cx.all_gather_compressed(codec))
    problem = tb.make_problem(replicas=4, examples=2)
    round_fn = harness.shard_round(outer, optax.sgd(0.1), mesh, 3)
    params = harness.initial_params(problem)
    state = jax.vmap(outer.init)(params)
    inner = jax.vmap(optax.sgd(0.1).init)(params)
    rep = jax.sharding.PartitionSpec("replica")
    args = [harness.place(t, mesh, rep) for t in (params, inner, state)]
    args.append(harness.place(jnp.asarray(problem.d), mesh, rep))
    args.append(
        harness.place(jnp.asarray(problem.c), mesh, jax.sharding.PartitionSpec("replica", "data"))
    )
    text = round_fn.lower(*args).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "replica")
    gathers = [c for c in found if c.op == "all-gather"]
    assert gathers and not [c for c in found if c.op == "all-reduce"]
    assert len(gathers) == 1 and {d for d, _ in gathers[0].shapes} == {"u32"}, gathers
    n = harness.flatten(params).shape[-1]
    words = -(-cx.int8(128).wire_bytes(n) // 4) * 4  # int8 values + float32 scales, padded
    assert gathers[0].bytes == 4 * words  # R payloads


def _two_step_reference(codec, payload):
    """numpy/per-replica twin of all_reduce_compressed on [R, n] rows: shards (of whole codec
    blocks) of the decoded payloads averaged, then the mean shard quantized again."""
    r, n = payload.shape
    m = shard_size(n, r, codec.block or 1)
    shards = np.pad(np.asarray(payload), ((0, 0), (0, r * m - n))).reshape(r, r, m)
    roundtrip = jax.jit(jax.vmap(codec.roundtrip))  # each row on its own
    decoded = np.stack([np.asarray(roundtrip(jnp.asarray(row))) for row in shards])
    mean = decoded.mean(axis=0)  # [shard, m]
    again = np.asarray(roundtrip(jnp.asarray(mean))).reshape(-1)
    return np.broadcast_to(again[:n], (r, n))


@pytest.mark.parametrize("name", ["none", "int8", "fp4", "2bit", "topk_2bit"])
@pytest.mark.parametrize("n", [5, 257])
@pytest.mark.cases("each")
def test_two_step_collective_is_the_requantized_mean(name, n):
    codec = CODECS[name]
    rng = np.random.default_rng(2)
    payload = jnp.asarray(rng.normal(size=(4, n)), jnp.float32)
    got = jax.jit(jax.vmap(cx.all_reduce_compressed(codec), axis_name="replica"))(payload)
    np.testing.assert_allclose(got, _two_step_reference(codec, payload), rtol=1e-6, atol=1e-7)
    if name == "none":  # uncompressed: the plain mean
        np.testing.assert_allclose(got[0], payload.mean(0), rtol=1e-6, atol=1e-7)


def test_two_step_collective_sends_half_the_gather_bytes():
    """In compiled HLO the two-step collective is R - 1 collective-permutes of an encoded
    shard (the reduce-scatter) then an all-gather of the encoded mean shards over the
    replica axis, each an encoding's arrays packed in one buffer of 32-bit words;
    reduce.wire_bytes counts 2 (R-1) encoded shards, which for 4 replicas is 1/2 of the
    all-gather's R-1 encoded payloads."""
    mesh = harness.make_mesh(replica=4, data=2)
    codec = cx.fp4(block=128)
    n = 4096
    reduce = cx.all_reduce_compressed(codec)
    fn = jax.jit(
        jax.shard_map(
            reduce,
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("replica"),
            out_specs=jax.sharding.PartitionSpec("replica"),
        )
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, n)), jnp.float32)
    want = _two_step_reference(codec, x)
    x = harness.place(x, mesh, jax.sharding.PartitionSpec("replica"))
    np.testing.assert_allclose(fn(x), want, rtol=1e-6, atol=1e-7)
    text = fn.lower(x).compile().as_text()
    every = co2jax.hlo.collectives(text)
    found = co2jax.hlo.over_axis(every, mesh, "replica")
    assert [c.op for c in found] == ["all-gather"], found
    permutes = [c for c in every if c.op == "collective-permute"]
    shard = codec.wire_bytes(n // 4)
    assert len(permutes) == 3, every
    for c in [*permutes, *found]:  # one word buffer per shard: what the codec sends
        (dtype, shape), count = c.shapes[0], (4 if c.op == "all-gather" else 1)
        assert dtype == "u32" and 4 * np.prod(shape) == count * shard, c
        # every group within one data column: only replicas exchange
        assert all(len({d % 2 for d in group}) == 1 for group in c.groups), c
    shapes = jax.ShapeDtypeStruct((n,), jnp.float32)
    assert reduce.wire_bytes(shapes, 4) == 2 * 3 * shard
    gather = cx.all_gather_compressed(codec).wire_bytes(shapes, 4)
    assert gather == 3 * codec.wire_bytes(n)
    assert reduce.wire_bytes(shapes, 4) / gather == pytest.approx(0.5)


def _ef_anchor(codec, use_ef, rounds=200):
    """DiLoCo on the textbook quadratic; the anchor averaged over the last half of the run."""
    problem = tb.make_problem(replicas=4, examples=2)
    outer = co2jax.diloco(optax.sgd(0.7, momentum=0.5), reduce=cx.all_gather_compressed(codec))
    if use_ef:
        outer = co2jax.error_feedback(outer)
    got, _ = harness.run_vmap(outer, problem, 0.1, 3, rounds)
    return got[rounds // 2 :].mean(axis=0)


def test_error_feedback_recovers_the_uncompressed_fixed_point():
    """Heterogeneous replicas: at DiLoCo's fixed point each replica's pseudo-gradient is
    non-zero and only their mean vanishes. Keeping one element in 8 (2-bit) biases the anchor
    away from it; with error feedback the anchor oscillates around the fixed point (bounded
    residual), and its average over rounds lands on it."""
    codec = cx.topk(1, chunk=8, values=cx.two_bit(block=4))
    exact = _ef_anchor(cx.none(), False)
    err_ef = np.abs(_ef_anchor(codec, True) - exact).max()
    err_plain = np.abs(_ef_anchor(codec, False) - exact).max()
    assert err_ef < 1e-2, err_ef
    assert err_plain > 50 * err_ef, (err_plain, err_ef)


def test_error_feedback_encodes_once_per_round():
    """Error feedback sends its encoding as it is: the collective does not encode it again,
    so the compiled sync has one abs-max pass, as without error feedback."""
    codec = cx.int8(128, implementation="xla")
    params = {"w": jnp.ones((1000,)), "b": jnp.ones((7,))}
    plain = co2jax.diloco(optax.sgd(0.7), reduce=cx.all_gather_compressed(codec))

    def abs_max_passes(outer):
        stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
        state = jax.vmap(outer.init)(stacked)
        sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
        hlo = sync.lower(stacked, state).compile().as_text()
        # one source call stack per abs-max computation left after optimisation
        return len(set(re.findall(r'vmap\(\)/reduce_max" stack_frame_id=(\d+)', hlo)))

    assert abs_max_passes(plain) == 1
    assert abs_max_passes(co2jax.error_feedback(plain)) == 1


def test_compression_none_is_uncompressed():
    problem = tb.make_problem(replicas=4, examples=2)
    plain, _ = harness.run_vmap(co2jax.diloco(optax.sgd(0.7)), problem, 0.1, 3, 5)
    outer = co2jax.error_feedback(
        co2jax.diloco(optax.sgd(0.7), reduce=cx.all_gather_compressed(cx.none()))
    )
    got, _ = harness.run_vmap(outer, problem, 0.1, 3, 5)
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)


def test_bad_arguments():
    with pytest.raises(ValueError, match="compression"):
        cx.make("fp3")
    with pytest.raises(ValueError, match="k=9"):
        cx.topk(9, chunk=8)
    with pytest.raises(ValueError, match="block"):
        cx.fp4(block=3)
    with pytest.raises(ValueError, match=r"decay=2\.0"):
        co2jax.error_feedback(co2jax.local_sgd(), decay=2.0)
    with pytest.raises(ValueError, match="compressed reducer"):
        co2jax.error_feedback(co2jax.local_sgd())
    two_step_topk = cx.all_reduce_compressed(cx.topk(1, chunk=4))
    with pytest.raises(ValueError, match="support"):
        co2jax.error_feedback(co2jax.diloco(optax.sgd(1.0), reduce=two_step_topk))


@pytest.mark.parametrize("shard_outer_state", [False, True], ids=["whole", "sharded"])
def test_round_engine_keeps_the_compressed_collective(shard_outer_state):
    """reducer="auto" keeps an algorithm's compressed collective, and bytes_communicated is
    the encoded size; the run equals the same algorithm under vmap."""
    from test_engine import run_engine

    problem = tb.make_problem(replicas=4, examples=2)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    codec = cx.int8(block=4)

    def make():
        reduce = cx.all_gather_compressed(codec)
        return co2jax.error_feedback(co2jax.diloco(co2jax.outer_sgd(0.7, 0.9, True), reduce=reduce))

    got, state, metrics, trainer = run_engine(
        make(), problem, mesh, shard_outer_state=shard_outer_state
    )
    assert trainer.program(state).reducer_kind == "outer"
    want, _ = harness.run_vmap(make(), problem, 0.1, 3, 5)
    # the same quantization blocks with the outer state split: the algorithm sees whole tensors
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # 5 parameters: 2 int8 blocks of 4 (8 bytes) + 2 float32 scales, to 3 other replicas
    np.testing.assert_array_equal(metrics[0].bytes_communicated, [3 * (8 + 8)] * 4)


def _int8_diloco(reduce_impl, implementation):
    if reduce_impl == "stacked":
        reduce = cx.all_gather_stacked(quantize="int8", implementation="xla")
    else:
        reduce = cx.all_gather_compressed(cx.int8(128, implementation=reduce_impl))
    return co2jax.diloco(co2jax.outer_sgd(0.7, 0.9, True), reduce=reduce, **implementation)


def test_int8_collective_feeds_the_fused_update():
    """With the fused update as a kernel, an int8 (block 128) all-gather sends the same
    format in the kernel's layout (one scale per 128-lane row) and the kernel dequantizes,
    averages and steps in one pass: no separate dequantize-mean. Equal to the slow twin
    (the same gathered codes averaged by Gathered.mean and stepped in jnp), and close to the
    flat-blocked int8 collective."""
    problem = tb.make_problem(replicas=4, examples=2)
    fused = _int8_diloco("interpret", dict(implementation="interpret"))
    twin = _int8_diloco("stacked", dict(implementation="xla"))
    flat = _int8_diloco("xla", dict(implementation="xla"))
    got, _ = harness.run_vmap(fused, problem, 0.1, 3, 4)
    want, _ = harness.run_vmap(twin, problem, 0.1, 3, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    other, _ = harness.run_vmap(flat, problem, 0.1, 3, 4)
    np.testing.assert_allclose(got, other, rtol=0.02, atol=0.02)

    params = harness.initial_params(problem)
    state = jax.vmap(fused.init)(params)
    jaxpr = str(jax.make_jaxpr(jax.vmap(fused.sync, axis_name="replica"))(params, state))
    assert "co2jax_quantize_int8" in jaxpr and "co2jax_outer_update" in jaxpr
    assert "co2jax_dequantize_mean_int8" not in jaxpr  # fused into the update


def test_engine_counts_the_fused_int8_layout():
    """On the engine the fused int8 path reports what it gathers: the kernel layout's rows,
    128 int8 codes and one float32 scale each, to the R - 1 other replicas."""
    from test_engine import run_engine

    from co2jax.kernels.api import gather_layout

    problem = tb.make_problem(replicas=4, examples=2)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    outer = _int8_diloco("interpret", dict(implementation="interpret"))
    # Pallas' interpreter is not typed for shard_map's varying-axis check; the twin with the
    # check on is test_round_engine_keeps_the_compressed_collective (the same int8 all-gather)
    got, _, metrics, _ = run_engine(outer, problem, mesh, rounds=2, check_vma=False)
    want, _ = harness.run_vmap(outer, problem, 0.1, 3, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    one = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    rows = gather_layout(one).total_rows
    np.testing.assert_array_equal(metrics[0].bytes_communicated, [3 * rows * 132] * 4)
