"""The chunked DCT and its top-k all-gather; DCT-momentum DiLoCo and DeMo against their numpy
textbook loops (tests/textbook_dct.py) under vmap, shard_map and the round engine."""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft
import textbook as tb
import textbook_dct as tbd
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import comm

TOL = harness.TOL[jnp.dtype(jnp.float32)]
LR, H, ROUNDS = 0.1, 3, 5
# the shared textbook problem (dim 16: "b" of 2, "w" of 14): chunk 8 cuts "w" into two chunks
# of 7 and keeps 3 of each; "b" (one chunk of 2) is sent whole
FLAT = dict(k=3, chunk=8, shapes=tbd.DEFAULT_SHAPES)
# a 2-D leaf: "w" of 8 x 12 in chunks of 4 x 6 (non-square: the largest divisors <= 6), 5 of
# the 24 coefficients of each kept
MATRIX = dict(k=5, chunk=6, shapes=((2,), (8, 12)))
CASES = {"flat": FLAT, "matrix": MATRIX}


def _matrix_unflatten(theta):
    return {"b": theta[..., :2], "w": theta[..., 2:].reshape(*theta.shape[:-1], 8, 12)}


def _matrix_flatten(params):
    w = params["w"]
    return jnp.concatenate([params["b"], w.reshape(*w.shape[:-2], 96)], axis=-1)


# the flat case is the registry matrix's setting (tests/test_matrix.py runs it in every
# driver): here it runs with -m slow (the suite's 15-minute budget); the matrix case is new
@pytest.fixture(
    params=[pytest.param("flat", marks=pytest.mark.slow), "matrix"], ids=["flat", "matrix"]
)
def case(request, monkeypatch):
    """(name, settings, problem); the matrix case swaps harness' parameter layout."""
    s = CASES[request.param]
    dim = sum(math.prod(x) for x in s["shapes"])
    if request.param == "matrix":
        monkeypatch.setattr(harness, "unflatten", _matrix_unflatten)
        monkeypatch.setattr(harness, "flatten", _matrix_flatten)
    return request.param, s, tb.make_problem(replicas=4, examples=2, dim=dim, seed=1)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 CPU devices")
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


# ---------------------------------------------------------------------------------------------
# the transform

SHAPES = [(96, 40), (100,), (64, 64), (128, 192), (8, 12), (97,), (4, 3, 5), (), (1, 7)]


def _reference(x: np.ndarray, chunk: int = 64) -> np.ndarray:
    """scipy's orthonormal DCT-II of every chunk, [chunks, coefficients], row-major."""
    return np.stack([q for q, _ in tbd.compress(x.reshape(x.shape or (1,)), 10**9, chunk)])


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_basis_is_scipy_dct(n):
    x = np.random.default_rng(n).normal(size=n)
    np.testing.assert_allclose(comm.dct_basis(n) @ x, scipy.fft.dct(x, type=2, norm="ortho"))
    assert comm.dct_basis(n) is comm.dct_basis(n)  # cached per size


def test_chunk_shape_is_the_largest_divisor():
    assert comm.dct_chunk_shape((96, 40)) == (48, 40)
    assert comm.dct_chunk_shape((100,)) == (50,)
    assert comm.dct_chunk_shape((64, 128)) == (64, 64)
    assert comm.dct_chunk_shape((97,)) == (1,)  # a prime above the target: chunks of 1
    assert comm.dct_chunk_shape((4, 3, 5)) == (4, 15)  # more axes: [shape[0], the rest]
    assert comm.dct_chunk_shape((8, 12), chunk=6) == (4, 6)
    assert [tbd.largest_divisor(n, 64) for n in (96, 40, 100, 97)] == [48, 40, 50, 1]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_chunked_dct_matches_scipy_and_inverts(shape):
    x = np.random.default_rng(0).normal(size=shape)
    got = comm.chunked_dct(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, _reference(x), rtol=1e-5, atol=1e-5)
    back = comm.chunked_idct(got, shape)
    assert back.shape == shape
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


def test_96x40_layout_by_hand():
    """Two 48 x 40 chunks stacked along rows, each flattened row-major."""
    x = np.random.default_rng(2).normal(size=(96, 40))
    want = [scipy.fft.dctn(x[i : i + 48], norm="ortho").reshape(-1) for i in (0, 48)]
    got = comm.chunked_dct(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(96, 40), (100,), (8, 12)], ids=str)
@pytest.mark.cases("first", 2)
def test_topk_keeps_the_largest_coefficients(shape):
    x = np.random.default_rng(3).normal(size=shape)
    k = 5  # < every chunk's size here
    idx, vals = comm.dct_topk(jnp.asarray(x, jnp.float32), k=k)
    want = tbd.compress(x, k, 64)
    assert idx.shape == (len(want), k)
    for row, (q, mask) in enumerate(want):
        assert set(np.asarray(idx[row]).tolist()) == set(np.flatnonzero(mask).tolist())
        np.testing.assert_allclose(vals[row], q[np.asarray(idx[row])], rtol=1e-5, atol=1e-5)
    encoded = comm.all_gather_dct_topk(k).encode({"x": jnp.asarray(x, jnp.float32)})
    decoded = tbd.decompress([q for q, _ in want], shape, 64)
    np.testing.assert_allclose(encoded.decode()["x"], decoded, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(decoded - x) > 0.1 * np.linalg.norm(x)  # k < chunk: lossy


def _payloads(R=4):
    rng = np.random.default_rng(4)
    return [{"a": rng.normal(size=(8, 12)), "b": rng.normal(size=(14,))} for _ in range(R)]


def _textbook_mean(payloads, k, chunk):
    flat = [np.concatenate([p["a"].ravel(), p["b"]]) for p in payloads]
    _, shared = tbd.sparse_round(flat, k, chunk, ((8, 12), (14,)))
    return {"a": shared[:96].reshape(8, 12), "b": shared[96:]}


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_contributor_mean_under_vmap_and_between_jobs():
    payloads = _payloads()
    stacked = jax.tree.map(lambda *x: jnp.asarray(np.stack(x), jnp.float32), *payloads)
    reduce = comm.all_gather_dct_topk(k=3, chunk=6)
    want = _textbook_mean(payloads, 3, 6)
    got = jax.vmap(reduce, axis_name="replica")(stacked)
    for key in want:
        for r in range(4):
            np.testing.assert_allclose(got[key][r], want[key], **TOL)
    # the gather form: each job encodes alone (no axis), the encodings stacked and combined
    encodings = [reduce.encode(jax.tree.map(lambda x, r=r: x[r], stacked)) for r in range(4)]
    joined = jax.tree.map(lambda *x: jnp.stack(x), *encodings).combine()
    for key in want:
        np.testing.assert_allclose(joined[key], want[key], **TOL)


def test_contributor_mean_under_shard_map(mesh):
    payloads = _payloads()
    stacked = jax.tree.map(lambda *x: jnp.asarray(np.stack(x), jnp.float32), *payloads)
    reduce = comm.all_gather_dct_topk(k=3, chunk=6)
    squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
    fn = jax.jit(
        jax.shard_map(
            lambda p: jax.tree.map(lambda x: x[None], reduce(squeeze(p))),
            mesh=mesh,
            in_specs=P("replica"),
            out_specs=P("replica"),
        )
    )
    got = fn(harness.place(stacked, mesh, P("replica")))
    want = _textbook_mean(payloads, 3, 6)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key])[2], want[key], **TOL)


# ---------------------------------------------------------------------------------------------
# DCT-momentum DiLoCo


def _dct_diloco(s, **kw):
    return co2jax.dct_diloco(0.7, 0.95, s["k"], s["chunk"], **kw)


def _dct_diloco_textbook(problem, s, **kw):
    return tbd.dct_diloco(problem, LR, H, ROUNDS, 0.7, 0.95, s["k"], s["chunk"], s["shapes"], **kw)


def test_the_residual_is_nonzero(case):
    """k < chunk: the first send leaves part of the momentum on the replica."""
    _, s, problem = case
    g = problem.theta0 - tb.inner_sgd(problem, 0, problem.theta0, LR, H)
    sent, _ = tbd.sparse_round([g], s["k"], s["chunk"], s["shapes"])
    assert np.linalg.norm(g - sent[0]) > 0.1 * np.linalg.norm(g)


def test_dct_diloco_vmap_matches_textbook(case):
    _, s, problem = case
    got, state = harness.run_vmap(_dct_diloco(s), problem, LR, H, ROUNDS)
    want = _dct_diloco_textbook(problem, s)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.ptp(want[-1], axis=0).max() > 1e-3  # the anchors are replica-local
    np.testing.assert_array_equal(state.count, [ROUNDS] * 4)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.delta))


def test_dct_diloco_shard_map_matches_textbook(case, mesh):
    _, s, problem = case
    got, _ = harness.run_shard_map(_dct_diloco(s), problem, LR, H, ROUNDS, mesh)
    np.testing.assert_allclose(got, _dct_diloco_textbook(problem, s), **TOL)


def test_dct_diloco_per_replica_weights(mesh):
    """One weight per replica in every driver: the round-level sync, the per-step adapter
    (``jax.vmap(tx.init)`` reads no replica axis), and the round engine (which once crashed
    on the unbound axis while sizing the payload)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    weights = (0.5, 1.0, 1.5, 1.0)  # H_r / mean_j H_j
    want = _dct_diloco_textbook(problem, FLAT, weights=weights)
    got, _ = harness.run_vmap(_dct_diloco(FLAT, weight=weights), problem, LR, H, ROUNDS)
    np.testing.assert_allclose(got, want, **TOL)
    outer = _dct_diloco(FLAT, weight=weights)
    got = harness.run_adapter(outer, optax.sgd(LR), problem, H, ROUNDS)
    np.testing.assert_allclose(got, want, **TOL)
    got, _ = _run_engine(optax.sgd(LR), _dct_diloco(FLAT, weight=weights), problem, mesh)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_dct_diloco_keeps_bf16_anchors():
    outer = co2jax.dct_diloco(k=1, chunk=2)
    params = jnp.ones((2, 4), jnp.bfloat16)
    state = jax.vmap(outer.init)(params)
    new, state = jax.vmap(outer.sync, axis_name="replica")(params * 0.5, state)
    assert new.dtype == state.anchor.dtype == jnp.bfloat16
    assert state.delta.dtype == jnp.float32


def _round_hlo(outer, inner, problem, mesh):
    params = harness.initial_params(problem)
    rep = P("replica")
    args = [
        harness.place(x, mesh, rep)
        for x in (params, jax.vmap(inner.init)(params), jax.vmap(outer.init)(params))
    ] + [
        harness.place(jnp.asarray(problem.d), mesh, rep),
        harness.place(jnp.asarray(problem.c), mesh, P("replica", "data")),
    ]
    return harness.shard_round(outer, inner, mesh, H).lower(*args).compile().as_text()


def _gathered_bytes(hlo, mesh) -> int:
    """Bytes the replica-axis all-gathers of a compiled program return."""
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(hlo), mesh, "replica")
    return sum(c.bytes for c in found if c.op == "all-gather")


def test_dct_diloco_sync_gathers_only_the_sparse_payload(mesh):
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    hlo = _round_hlo(_dct_diloco(FLAT), optax.sgd(LR), problem, mesh)
    assert harness.count_replica_collectives(hlo, mesh, "all-reduce") == 0
    assert 1 <= harness.count_replica_collectives(hlo, mesh, "all-gather") <= 2
    # per replica: "b" keeps 2 of its 2, "w" 3 in each of its 2 chunks: 8 indices (uint16)
    # + 8 values (float32), gathered as the bytes of one buffer
    assert _gathered_bytes(hlo, mesh) == 4 * (8 * 2 + 8 * 4)


def test_bytes_per_sync_against_diloco():
    """A 4096 x 4096 matrix: 64 x 64 chunks, 32 of 4096 coefficients kept in each, a uint16
    index and a float32 value per kept coefficient (6 bytes against 4 per element dense)."""
    matrix = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    outer, dense = co2jax.dct_diloco(), co2jax.diloco(optax.sgd(0.7, 0.9, nesterov=True))
    kept = 64 * 64 * 32
    assert outer.reducer.wire_bytes(matrix, 2) == kept * 6  # one payload to the other replica
    assert 4 * 4096 * 4096 / (kept * 6) == pytest.approx(85.33, abs=0.01)  # vs dense float32
    for R, ratio in [(2, 85.33), (4, 42.67), (8, 21.33), (16, 10.67)]:
        # DiLoCo's ring all-reduce sends 2 (R-1)/R of its float32 payload; the all-gather
        # sends the sparse one to each of the R-1 others: the ratio is 170.7 / R
        got = dense.reducer.wire_bytes(matrix, R) / outer.reducer.wire_bytes(matrix, R)
        assert got == pytest.approx(ratio, abs=0.01)
    # a 1-D leaf is cut into chunks of 64 and keeps 32 of each: 32 * 6 bytes against 64 * 4
    vector = {"b": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    assert 4 * 4096 / outer.reducer.wire_bytes(vector, 2) == pytest.approx(4 / 3)


# ---------------------------------------------------------------------------------------------
# DeMo

DEMO_LR, DEMO_BETA = 0.05, 0.9


def _demo(s, **kw):
    return co2jax.demo(DEMO_LR, DEMO_BETA, s["k"], s["chunk"], **kw)


def _demo_textbook(problem, s, wd=0.0):
    return tbd.demo(problem, DEMO_LR, H, ROUNDS, DEMO_BETA, s["k"], s["chunk"], s["shapes"], wd)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_demo_vmap_matches_textbook(case, wd):
    _, s, problem = case
    got, step, state = harness.run_vmap_steps(_demo(s, weight_decay=wd), problem, H * ROUNDS, H)
    np.testing.assert_allclose(got, _demo_textbook(problem, s, wd), **TOL)
    assert step._cache_size() == 1
    np.testing.assert_array_equal(state.count, [H * ROUNDS] * 4)
    assert any(np.abs(np.asarray(x)).max() > 1e-4 for x in jax.tree.leaves(state.delta))


def _shard_steps(tx, problem, mesh, steps, every):
    step = harness.shard_step(tx, mesh)
    params, state, d, c = harness.shard_step_args(tx, problem, mesh)
    out = []
    for i in range(steps):
        params, state = step(params, state, d, c)
        if (i + 1) % every == 0:
            out.append(np.asarray(harness.flatten(params), np.float64))
    return np.stack(out), step, (params, state, d, c)


def test_demo_shard_map_matches_textbook(case, mesh):
    _, s, problem = case
    got, *_ = _shard_steps(_demo(s), problem, mesh, H * ROUNDS, H)
    np.testing.assert_allclose(got, _demo_textbook(problem, s), **TOL)


def test_demo_gathers_every_step_and_never_all_reduces_the_gradient(mesh):
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    tx = _demo(FLAT)
    _, step, args = _shard_steps(tx, problem, mesh, 1, 1)
    hlo = step.lower(*args).compile().as_text()
    assert harness.count_replica_collectives(hlo, mesh, "all-reduce") == 0
    assert 1 <= harness.count_replica_collectives(hlo, mesh, "all-gather") <= 2
    assert _gathered_bytes(hlo, mesh) == 4 * (8 * 2 + 8 * 4)  # uint16 indices, f32 values


def _engine_loss(params, batch):
    theta = harness.flatten(params)
    return jnp.mean(0.5 * jnp.sum(batch["d"] * (theta - batch["c"]) ** 2, axis=-1))


def _run_engine(inner, outer, problem, mesh):
    trainer = co2jax.RoundTrainer(_engine_loss, inner, outer, mesh, sync_every=H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    R, K, dim = problem.c.shape
    batch = {
        "c": jnp.asarray(np.broadcast_to(problem.c[:, None], (R, H, K, dim)), jnp.float32),
        "d": jnp.asarray(np.broadcast_to(problem.d[:, None, None], (R, H, K, dim)), jnp.float32),
    }
    out = []
    for _ in range(ROUNDS):
        state, metrics = trainer.round(state, batch)
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    assert trainer.program(state).fn._cache_size() == 1
    return np.stack(out), np.asarray(metrics.bytes_communicated)


def test_round_engine_runs_both(mesh):
    """DeMo as the inner transform with no_sync outside (as DDP runs); DCT DiLoCo as the outer
    optimizer of plain SGD."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    got, _ = _run_engine(_demo(FLAT), co2jax.no_sync(), problem, mesh)
    np.testing.assert_allclose(got, _demo_textbook(problem, FLAT), **TOL)
    outer = _dct_diloco(FLAT)
    got, sent = _run_engine(optax.sgd(LR), outer, problem, mesh)
    np.testing.assert_allclose(got, _dct_diloco_textbook(problem, FLAT), **TOL)
    # the engine counts the encoded payload: 8 (uint16 index, float32 value) pairs to 3 peers
    shapes = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    assert outer.reducer.wire_bytes(shapes, 4) == 3 * 8 * 6
    np.testing.assert_array_equal(sent, [3 * 8 * 6] * 4)


def test_demo_learning_rate_schedule_enters_the_momentum():
    """A schedule is read at the step count for the momentum and the step alike. With a
    constant lr, lr * g in the momentum is invisible (top-k and sign ignore a common scale);
    a decaying one tells ``beta delta + lr_t g`` from ``lr_t`` on the step only."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    tx = co2jax.demo(optax.exponential_decay(DEMO_LR, 1, 0.8), DEMO_BETA, 3, 8)
    got, *_ = harness.run_vmap_steps(tx, problem, H * ROUNDS, H)
    rate = lambda t: DEMO_LR * 0.8**t
    want = tbd.demo(problem, rate, H, ROUNDS, DEMO_BETA, 3, 8)
    np.testing.assert_allclose(got, want, **TOL)


# ---------------------------------------------------------------------------------------------
# arguments


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: co2jax.dct_diloco(learning_rate=0.0), "learning_rate"),
        (lambda: co2jax.dct_diloco(decay=1.0), "decay"),
        (lambda: co2jax.dct_diloco(k=0), "k"),
        (lambda: co2jax.dct_diloco(chunk=1.5), "chunk"),
        (lambda: co2jax.dct_diloco(weight=-1.0), "weight"),
        (lambda: co2jax.dct_diloco(weight=()), "weight"),
        (lambda: co2jax.dct_diloco(axis_name=""), "axis_name"),
        (lambda: co2jax.demo(-0.1), "learning_rate"),
        (lambda: co2jax.demo(0.1, decay=-0.5), "decay"),
        (lambda: co2jax.demo(0.1, k=True), "k"),
        (lambda: co2jax.demo(0.1, chunk=0), "chunk"),
        (lambda: co2jax.demo(0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: comm.all_gather_dct_topk(k=0), "k"),
        (lambda: comm.all_gather_dct_topk(chunk=0), "chunk"),
        (lambda: comm.dct_basis(0), "n"),
    ],
)
def test_bad_arguments_raise_value_error(make, name):
    with pytest.raises(ValueError, match=name):
        make()
