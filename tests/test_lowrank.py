"""int4, the low-rank codec with warm start and error feedback, and DiLoCoX (reconstructed):
against numpy (``textbook_lowrank``) under vmap, shard_map, the round engine, the per-step
adapter and separate jobs; bytes, identities, the adaptive controller and bad arguments."""

from __future__ import annotations

import itertools
import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_lowrank as tl
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import comm as cx
from co2jax.algorithms import adapt, carry_over, exchange_seconds
from co2jax.comm import chunks, lowrank
from co2jax.comm.reducer import ring_bytes

LR, H, ROUNDS = 0.1, 3, 5
TOL = harness.TOL[jnp.dtype(jnp.float32)]
SHAPES = ((2,), (4, 6))  # "b" dense, "w" a 4x6 matrix: rank 2 sends (4 + 6) 2 = 20 < 24
DIM, RANK = 26, 2


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, dim=DIM, seed=3)


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


def unflatten(theta):
    return {"b": theta[..., :2], "w": theta[..., 2:].reshape(*theta.shape[:-1], *SHAPES[1])}


def flatten(params):
    w = params["w"]
    return jnp.concatenate([params["b"], w.reshape(*w.shape[:-2], -1)], axis=-1)


def loss(params, d, c):
    return jnp.mean(0.5 * jnp.sum(d * (flatten(params) - c) ** 2, axis=-1))


def engine_loss(params, batch):
    return loss(params, batch["d"], batch["c"])


def q0(rank=RANK, seed=0):
    one = {"b": jnp.zeros(SHAPES[0]), "w": jnp.zeros(SHAPES[1])}
    return [np.asarray(q, np.float64) for q in cx.initial_factors(one, rank, seed)]


def _initial(problem):
    theta = jnp.broadcast_to(jnp.asarray(problem.theta0, jnp.float32), (problem.replicas, DIM))
    return unflatten(theta)


def _steps(inner, params, inner_state, grad_fn):
    def step(carry, _):
        p, s = carry
        u, s = inner.update(grad_fn(p), s, p)
        return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(step, (params, inner_state), None, length=H)[0]


def _record(params):
    return np.asarray(flatten(jax.device_get(params)), np.float64)


# ---------------------------------------------------------------------------------------------
# drivers: each returns ([rounds, R, DIM] anchors, the low-rank state per round)


def run_vmap(outer, problem, rounds=ROUNDS):
    inner, params = optax.sgd(LR), _initial(problem)
    state, inner_state = jax.vmap(outer.init)(params), jax.vmap(inner.init)(params)
    d, c = jnp.asarray(problem.d, jnp.float32), jnp.asarray(problem.c, jnp.float32)

    def replica(params, inner_state, state, d, c):
        grad = lambda p: jax.grad(loss)(p, d, c)
        params, inner_state = _steps(inner, params, inner_state, grad)
        return (*outer.sync(params, state), inner_state)

    round_fn = jax.jit(jax.vmap(replica, axis_name="replica"))
    out, states = [], []
    for _ in range(rounds):
        params, state, inner_state = round_fn(params, inner_state, state, d, c)
        out.append(_record(params))
        states.append(state)
    return np.stack(out), states


def shard_round(outer, inner, mesh):
    one, back = (
        (lambda t: jax.tree.map(lambda x: x[0], t)),
        (lambda t: jax.tree.map(lambda x: x[None], t)),
    )

    def body(params, inner_state, state, d, c):
        params, inner_state, state, d = map(one, (params, inner_state, state, d))

        def grad_fn(p):  # this data shard's gradient, then the mean over the data shards
            p = jax.lax.pcast(p, "data", to="varying")
            return jax.lax.pmean(jax.grad(loss)(p, d, c[0]), "data")

        params, inner_state = _steps(inner, params, inner_state, grad_fn)
        params, state = outer.sync(params, state)
        return back(params), back(inner_state), back(state)

    rep = P("replica")
    specs = (rep, rep, rep, rep, P("replica", "data"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(rep,) * 3))


def _shard_args(outer, inner, problem, mesh):
    params = _initial(problem)
    rep = P("replica")
    state = harness.place(jax.vmap(outer.init)(params), mesh, rep)
    inner_state = harness.place(jax.vmap(inner.init)(params), mesh, rep)
    d = harness.place(jnp.asarray(problem.d, jnp.float32), mesh, rep)
    c = harness.place(jnp.asarray(problem.c, jnp.float32), mesh, P("replica", "data"))
    return harness.place(params, mesh, rep), inner_state, state, d, c


def run_shard_map(outer, problem, mesh, rounds=ROUNDS):
    inner = optax.sgd(LR)
    params, inner_state, state, d, c = _shard_args(outer, inner, problem, mesh)
    round_fn = shard_round(outer, inner, mesh)
    out, states = [], []
    for _ in range(rounds):
        params, inner_state, state = round_fn(params, inner_state, state, d, c)
        out.append(_record(params))
        states.append(state)
    return np.stack(out), states


def textbook_batch(problem):
    R, K, dim = problem.c.shape
    c = np.broadcast_to(problem.c[:, None], (R, H, K, dim))
    d = np.broadcast_to(problem.d[:, None, None], (R, H, K, dim))
    return {"c": jnp.asarray(c, jnp.float32), "d": jnp.asarray(d, jnp.float32)}


def run_engine(outer, problem, mesh, rounds=ROUNDS, metrics=None):
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H)
    state = trainer.init(unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out, states = [], []
    for _ in range(rounds):
        state, m = trainer.round(state, textbook_batch(problem))
        out.append(_record(state.params))
        states.append(state.outer_state)
        if metrics is not None:
            metrics.append(m)
    assert trainer.program(state).reducer_kind == "outer"
    return np.stack(out), states


def run_adapter(outer, problem, rounds=ROUNDS):
    tx = co2jax.local_updates(optax.sgd(LR), outer, H, spread=False)
    params = _initial(problem)
    state = jax.vmap(tx.init)(params)
    d, c = jnp.asarray(problem.d, jnp.float32), jnp.asarray(problem.c, jnp.float32)

    def step(params, state, d, c):
        updates, state = tx.update(jax.grad(loss)(params, d, c), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(step, axis_name="replica"))
    out, states = [], []
    for i in range(rounds * H):
        params, state = step(params, state, d, c)
        if (i + 1) % H == 0:
            out.append(_record(params))
            states.append(state.outer_state)
    return np.stack(out), states


def run_jobs(outer, problem, rounds=ROUNDS):
    """Every replica as a job: no replica axis, its own init, sends and applies; the
    encodings stacked in rank order and combined, as co2jax.JobTrainer exchanges them."""
    R, inner = problem.replicas, optax.sgd(LR)
    one = unflatten(jnp.asarray(problem.theta0, jnp.float32))
    params, states = [one] * R, [jax.jit(outer.init)(one)] * R
    inner_states = [inner.init(one)] * R
    d, c = jnp.asarray(problem.d, jnp.float32), jnp.asarray(problem.c, jnp.float32)
    steps = jax.jit(lambda p, s, d, c: _steps(inner, p, s, lambda q: jax.grad(loss)(q, d, c)))
    send = jax.jit(outer.send, static_argnums=2)
    apply = jax.jit(outer.apply, static_argnums=2)
    combine = jax.jit(lambda e: e.combine())
    delayed = outer.schedule[0].send == 0
    out, history = [], []
    for _ in range(rounds):
        sent = [None] * R
        for r in range(R):
            if delayed:  # sent before the steps: it depends on the state only
                sent[r], states[r] = send(params[r], states[r], 0)
            params[r], inner_states[r] = steps(params[r], inner_states[r], d[r], c[r])
            if not delayed:
                sent[r], states[r] = send(params[r], states[r], 0)
        reduced = combine(jax.tree.map(lambda *e: jnp.stack(e), *sent))
        for r in range(R):
            params[r], states[r] = apply(params[r], states[r], 0, reduced)
        out.append(np.stack([_record(p) for p in params]))
        history.append(jax.tree.map(lambda *x: jnp.stack(x), *states))
    return np.stack(out), history


DRIVERS = {
    "vmap": lambda outer, problem, mesh: run_vmap(outer, problem),
    "shard_map": lambda outer, problem, mesh: run_shard_map(outer, problem, mesh),
    "engine": lambda outer, problem, mesh: run_engine(outer, problem, mesh),
    "adapter": lambda outer, problem, mesh: run_adapter(outer, problem),
    "jobs": lambda outer, problem, mesh: run_jobs(outer, problem),
}
ALGORITHMS = {
    "diloco_low_rank": (
        lambda: co2jax.low_rank(co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)), RANK),
        lambda p, **kw: tl.diloco_low_rank(p, LR, H, ROUNDS, 0.7, 0.9, SHAPES, RANK, q0(), **kw),
    ),
    "diloco_x": (
        lambda: co2jax.diloco_x(optax.sgd(0.5, momentum=0.5, nesterov=True), RANK),
        lambda p, **kw: tl.diloco_x(p, LR, H, ROUNDS, 0.5, 0.5, SHAPES, RANK, q0(), **kw),
    ),
}
PAIRS = [(a, d) for a in ALGORITHMS for d in DRIVERS]
# DiLoCoX in every driver; the low-rank DiLoCo in vmap and the engine by default, its other
# drivers with -m slow (the suite's 15-minute budget)
CELLS = [
    (a, d)
    if a == "diloco_x" or d in ("vmap", "engine")
    else pytest.param(a, d, marks=pytest.mark.slow)
    for a, d in PAIRS
]


@pytest.mark.parametrize("name, driver", CELLS, ids=[f"{a}-{d}" for a, d in PAIRS])
@pytest.mark.cases("first", 2)
def test_matches_textbook(name, driver, problem, mesh):
    make, loop = ALGORITHMS[name]
    want, extra = loop(problem)
    got, states = DRIVERS[driver](make(), problem, mesh)
    np.testing.assert_allclose(got, want, **TOL)
    residual = np.asarray(jax.device_get(states[-1].residuals[0]["w"])).reshape(4, -1)
    assert (np.abs(residual).max(axis=1) > 1e-3).all()  # rank 2 < 4: something left out
    np.testing.assert_allclose(residual, extra["residuals"][:, 2:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_textbook_loops_compress(name, problem):
    """The loops are not DiLoCo in disguise: compression moves the trajectory, and a factor
    format (int4) or a cold start (no warm start) moves it again."""
    want, _ = ALGORITHMS[name][1](problem)
    eta, mu, delay = (0.7, 0.9, 0) if name == "diloco_low_rank" else (0.5, 0.5, 1)
    dense = tb.diloco_nesterov(problem, LR, H, ROUNDS, eta, mu, delay=delay)
    assert np.abs(want - dense).max() > 1e-2
    cold, _ = ALGORITHMS[name][1](problem, warm=False)
    assert np.abs(want - cold).max() > 1e-3
    assert np.abs(want[-1] - problem.theta0).max() > 1e-1


def test_warm_start_moves_q(problem):
    """Q is each replica's own: after round 1 it is Q' = M^T P, no longer the seed's; round 2
    starts from it and moves it again; the textbook's Q's agree."""
    _, states = run_vmap(ALGORITHMS["diloco_low_rank"][0](), problem, rounds=2)
    _, extra = tl.diloco_low_rank(problem, LR, H, 2, 0.7, 0.9, SHAPES, RANK, q0())
    first = q0()[0]
    q1, q2 = (np.asarray(s.factors[0][0]) for s in states)
    for r in range(4):
        assert np.abs(q1[r] - first).max() > 1e-2 and np.abs(q2[r] - q1[r]).max() > 1e-4
        for t, q in enumerate((q1, q2)):
            np.testing.assert_allclose(q[r], extra["factors"][t][r][0], rtol=1e-4, atol=1e-5)
    assert np.abs(q1[0] - q1[1]).max() > 1e-3  # replica-varying


def test_fused_outer_update_matches_textbook(problem):
    """With co2jax.outer_sgd the delayed apply is the fused update (its jnp path here)."""
    outer = co2jax.diloco_x(co2jax.outer_sgd(0.5, 0.5, nesterov=True), RANK, implementation="xla")
    got, _ = run_vmap(outer, problem)
    np.testing.assert_allclose(got, ALGORITHMS["diloco_x"][1](problem)[0], **TOL)


def test_types_dtypes_and_abstract_init(problem):
    """bf16 parameters stay bf16 (factors and residuals are float32), the state's types are
    stable across syncs (one compilation), and init runs on ShapeDtypeStructs."""
    outer = ALGORITHMS["diloco_x"][0]()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _initial(problem))
    state = jax.vmap(outer.init)(params)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(2):
        out, state = sync(jax.tree.map(lambda x: x - 0.1, params), state)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before
    assert sync._cache_size() == 1
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.residuals)} == {jnp.dtype(jnp.float32)}
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    abstract = jax.eval_shape(outer.init, one)
    assert abstract.factors[0][0].shape == (6, RANK)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_full_rank_is_diloco(problem):
    """rank = min(m, n) saves no bytes: every leaf goes dense (exact in float32), which is
    uncompressed DiLoCo; and the factors themselves reproduce M at full rank."""
    rank = min(SHAPES[1])
    assert not lowrank.factored(SHAPES[1], rank)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    got, states = run_vmap(co2jax.low_rank(co2jax.diloco(outer), rank), problem)
    want, _ = run_vmap(co2jax.diloco(outer), problem)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.asarray(states[-1].residuals[0]["w"]).any()
    m = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)
    p, q = lowrank.power_step(m, jax.random.normal(jax.random.key(1), (6, rank)))
    np.testing.assert_allclose(p @ q.T, m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p.T @ p, np.eye(rank), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the codec


PAYLOAD_SHAPES = ((2,), (3, 4, 5), (4, 6))  # leaves "b", "v" (3x20), "w" (4x6), in key order


def _payloads(replicas=4, seed=2):
    rng = np.random.default_rng(seed)
    return {
        k: jnp.asarray(rng.normal(size=(replicas, *s)), jnp.float32)
        for k, s in zip("bvw", PAYLOAD_SHAPES, strict=True)
    }


def _numpy_mean(x, factors, rank=RANK, block=128):
    flat = np.concatenate([np.asarray(x[k], np.float64).reshape(4, -1) for k in "bvw"], axis=1)
    one = {k: v[0] for k, v in x.items()}
    qs = [np.asarray(q, np.float64) for q in cx.initial_factors(one, rank)]
    approx = [tl.compress(row, PAYLOAD_SHAPES, qs, rank, factors, block)[0] for row in flat]
    return np.mean(approx, axis=0)


@pytest.mark.parametrize("factors", ["float32", "int4"])
def test_combine_is_the_mean_of_the_approximations(factors):
    x = _payloads()
    reduce = cx.all_gather_low_rank(RANK, factors, block=16)
    got = jax.jit(jax.vmap(reduce, axis_name="replica"))(x)
    flat = np.concatenate([np.asarray(got[k][0]).reshape(-1) for k in "bvw"])
    np.testing.assert_allclose(flat, _numpy_mean(x, factors, block=16), rtol=1e-4, atol=1e-5)
    for k in x:  # every replica holds the same mean
        np.testing.assert_array_equal(np.asarray(got[k]), np.broadcast_to(got[k][0], x[k].shape))


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_bf16_factors_are_float32_factors_rounded():
    x = _payloads()
    run = lambda f: jax.vmap(cx.all_gather_low_rank(RANK, f), axis_name="replica")(x)
    exact, rounded = run("float32"), run("bf16")
    for k in x:
        scale = float(np.abs(np.asarray(exact[k])).max())
        np.testing.assert_allclose(rounded[k], exact[k], atol=2e-2 * scale)
        assert rounded[k].dtype == jnp.float32


@pytest.mark.parametrize("factors", lowrank.FACTORS)
@pytest.mark.cases("first", 2)
def test_wire_bytes_are_the_buffer(factors):
    reduce = cx.all_gather_low_rank(RANK, factors, block=16)
    one = {k: v[0] for k, v in _payloads().items()}
    encoded = reduce.encode(one)
    (buf,) = encoded.data  # one uint8 buffer for the group: one all-gather
    assert buf.dtype == jnp.uint8
    p, q, d = 2 * (4 + 3), 2 * (6 + 20), 2  # P: r (m_v + m_w); Q': r (n_v + n_w); dense: b
    per = {"float32": lambda k: 4 * k, "bf16": lambda k: 2 * k}
    size = per.get(factors, lambda k: math.ceil(k / 16) * (8 + 4))
    assert buf.size == size(p) + size(q) + size(d) == lowrank.encoded_bytes(one, RANK, factors, 16)
    assert reduce.wire_bytes(one, 4) == 3 * buf.size


def test_bytes_per_sync_against_dilocos_dense_payload():
    """What one replica sends per sync, wire_bytes against DiLoCo's all-reduce of the dense
    float32 payload (2 (R-1)/R of it): the test's tiny model (where padding and R = 4 make
    the gather lose), and a 4096x4096 matrix with its bias at rank 32."""
    dense = co2jax.diloco(optax.sgd(0.7)).reducer
    tiny = {
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
        "w": jax.ShapeDtypeStruct((4, 6), jnp.float32),
    }
    big = {
        "b": jax.ShapeDtypeStruct((4096,), jnp.float32),
        "w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
    }
    rows = []
    for label, shapes, rank, R in (
        ("tiny", tiny, RANK, 4),
        ("4096^2", big, 32, 4),
        ("4096^2", big, 32, 2),
    ):
        for factors in lowrank.FACTORS:
            sent = cx.all_gather_low_rank(rank, factors).wire_bytes(shapes, R)
            base = dense.wire_bytes(shapes, R)
            rows.append((label, R, factors, sent, base))
            ratio = base / sent
            print(
                f"{label} R={R} {factors:>7}: {sent:11.0f} B, DiLoCo {base:11.0f} B: {ratio:6.1f}x"
            )
    n = 4096 * 4096 + 4096
    by = {(lab, R, f): (s, b) for lab, R, f, s, b in rows}
    assert by[("tiny", 4, "float32")] == (3 * 4 * (8 + 12 + 2), ring_bytes(4 * 26, 4))
    assert by[("tiny", 4, "int4")][0] == 3 * 3 * (64 + 4)  # three vectors, one block each
    s, b = by[("4096^2", 4, "int4")]
    blocks = 2 * 32 * 4096 // 128 + 4096 // 128  # P, Q' and the bias, in blocks of 128
    assert (s, b) == (3 * blocks * 68, 1.5 * 4 * n)
    assert b / s == pytest.approx(237.3, abs=0.1)
    s, b = by[("4096^2", 2, "int4")]
    assert b / s == pytest.approx(474.6, abs=0.1)  # R = 2: the gather is the ring's bytes
    assert by[("4096^2", 4, "float32")][1] / by[("4096^2", 4, "float32")][0] == pytest.approx(
        2 * 4096 * 4096 / (4 * 2 * 4096 * 32), rel=0.02
    )  # 2 m n / (R (m + n) r): the gather at R = 4


def test_engine_reports_the_factor_bytes(problem, mesh):
    metrics = []
    outer = ALGORITHMS["diloco_x"][0]()
    run_engine(outer, problem, mesh, rounds=1, metrics=metrics)
    one = jax.tree.map(lambda x: x[0], _initial(problem))
    np.testing.assert_array_equal(
        metrics[0].bytes_communicated, [outer.reducer.wire_bytes(one, 4)] * 4
    )


def test_one_all_gather_of_bytes_and_no_all_reduce(problem, mesh):
    outer, inner = ALGORITHMS["diloco_x"][0](), optax.sgd(LR)
    args = _shard_args(outer, inner, problem, mesh)
    hlo = shard_round(outer, inner, mesh).lower(*args).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(hlo), mesh, "replica")
    assert [c.op for c in found] == ["all-gather"], found
    assert {dtype for c in found for dtype, _ in c.shapes} == {"u8"}


def test_spread_and_data_shards_are_refused(problem, mesh):
    outer = ALGORITHMS["diloco_x"][0]()
    assert not outer.reducer.chunkable
    with pytest.raises(ValueError, match=r"spread=True: .* only whole"):
        co2jax.local_updates(optax.sgd(LR), outer, H, spread=True)
    # by default a reducer that is not chunkable is sent whole: the spread=False schedule
    auto = co2jax.local_updates(optax.sgd(LR), outer, H).init(
        jax.tree.map(lambda x: x[0], _initial(problem))
    )
    assert not isinstance(auto.inflight[0], chunks.Buffer)  # held whole, not as chunk buffers
    reduce = cx.all_gather_low_rank(1)
    body = jax.shard_map(
        lambda x: reduce(x[0])[None], mesh=mesh, in_specs=P("replica", "data"),
        out_specs=P("replica", "data"),
    )  # fmt: skip
    x = harness.place(jnp.ones((4, 8, 6)), mesh, P("replica", "data"))
    with pytest.raises(ValueError, match="'data'"):
        jax.jit(body)(x)


def test_non_finite_round_is_skipped_and_the_state_kept(problem):
    """A NaN pseudo-gradient (sent one round later) decodes to NaN, the guard inside skips
    that step, and the replica's residual and Q stay finite: the next rounds run on."""
    outer = co2jax.diloco_x(optax.sgd(0.5), RANK, skip_nonfinite=True)
    params = _initial(problem)
    state = jax.vmap(outer.init)(params)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    bad = jax.tree.map(lambda x: x.at[1].set(jnp.nan), params)
    for p in (bad, params, params):
        anchor, state = sync(p, state)
        assert np.isfinite(np.asarray(flatten(anchor))).all()
        for leaf in jax.tree.leaves((state.factors, state.residuals)):
            assert np.isfinite(np.asarray(leaf)).all()
    assert int(state.inner_state.num_skipped[0]) == 1


def test_carry_over_keeps_the_run_and_restarts_q(problem):
    make = lambda rank: co2jax.diloco_x(optax.sgd(0.5, momentum=0.5), rank)
    _, states = run_vmap(make(2), problem, rounds=2)
    old, params = states[-1], _initial(problem)
    same = carry_over(jax.vmap(make(2).init)(params), old)
    jax.tree.map(np.testing.assert_array_equal, same, old)
    fresh = jax.vmap(make(1).init)(params)
    moved = carry_over(fresh, old)
    assert moved.factors[0][0].shape == (4, 6, 1)
    np.testing.assert_array_equal(moved.factors[0][0], fresh.factors[0][0])  # Q from the seed
    jax.tree.map(np.testing.assert_array_equal, moved.residuals, old.residuals)
    jax.tree.map(np.testing.assert_array_equal, moved.inner_state, old.inner_state)
    with pytest.raises(ValueError, match="inner_state"):
        carry_over(jax.vmap(co2jax.low_rank(co2jax.diloco(optax.sgd(0.5)), 2).init)(params), old)


# ---------------------------------------------------------------------------------------------
# the controller


CASES = [  # (rank, H, compute, exchange, keywords) -> (rank, H)
    ((32, 100, 10.0, 14.0, {}), (16, 100)),  # exposed: halve the rank
    ((3, 100, 10.0, 14.0, {"min_rank": 2}), (2, 100)),  # never below min_rank
    ((1, 100, 10.0, 14.0, {}), (1, 200)),  # at min_rank: double H
    ((1, 300, 10.0, 14.0, {"max_sync_every": 400}), (1, 400)),  # up to the cap
    ((1, 400, 10.0, 14.0, {"max_sync_every": 400}), (1, 400)),  # both limits: hold
    ((16, 100, 10.0, 4.9, {}), (32, 100)),  # slack: double the rank
    ((16, 100, 10.0, 4.9, {"max_rank": 20}), (20, 100)),  # up to max_rank
    ((20, 100, 10.0, 4.9, {"max_rank": 20}), (20, 100)),  # at max_rank: hold
    ((1, 200, 10.0, 4.9, {"min_sync_every": 100}), (1, 100)),  # H comes back first
    ((1, 100, 10.0, 4.9, {"min_sync_every": 100}), (2, 100)),  # then the rank
    ((16, 100, 10.0, 5.0, {}), (16, 100)),  # the band [1/2, 1]: hold
    ((16, 100, 10.0, 10.0, {}), (16, 100)),
    ((16, 100, 10.0, 0.0, {}), (32, 100)),
]


@pytest.mark.parametrize("args, want", CASES)
def test_controller_rule(args, want):
    *positional, keywords = args
    assert adapt(*positional, **keywords) == want


def test_controller_hysteresis():
    """A bandwidth-bound exchange (seconds proportional to the rank): from any start the
    rule settles on one setting and stays there, no step undoing the one before."""
    for per_rank in (0.01, 0.3, 0.7, 4.0, 30.0):
        rank, sync_every, seen = 64, 10, []
        for _ in range(40):
            compute = 0.1 * sync_every
            rank, sync_every = adapt(rank, sync_every, compute, per_rank * rank * 0.05, max_rank=64)
            seen.append((rank, sync_every))
        assert len(set(seen[-10:])) == 1, (per_rank, seen)
        changes = [a != b for a, b in itertools.pairwise(seen)]
        assert sum(changes) <= 12


def test_exchange_seconds_from_job_metrics():
    m = lambda wait, nbytes=10**9: co2jax.JobMetrics(None, 10.0, wait, 10.0 + wait, nbytes)
    assert exchange_seconds(m(4.0)) == 14.0
    assert exchange_seconds(m(0.0)) == 10.0  # hidden: at most the compute
    assert exchange_seconds(m(0.0), link_bytes_per_s=1e9) == 1.0
    assert exchange_seconds(m(0.05), 1e9, min_wait_s=0.1) == 1.0  # a wait this short is noise
    assert adapt(8, 50, 10.0, exchange_seconds(m(0.0))) == (8, 50)  # no guess, no raise


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: adapt(0, 10, 1.0, 1.0), "rank=0"),
        (lambda: adapt(4, 0, 1.0, 1.0), "sync_every=0"),
        (lambda: adapt(4, 10, 0.0, 1.0), "round_compute_s=0.0"),
        (lambda: adapt(4, 10, 1.0, -1.0), "exchange_s=-1.0"),
        (lambda: adapt(4, 10, 1.0, float("nan")), "exchange_s=nan"),
        (lambda: adapt(1, 10, 1.0, 1.0, min_rank=2), "rank=1"),
        (lambda: adapt(4, 10, 1.0, 1.0, max_rank=2), "max_rank=2"),
        (lambda: adapt(4, 10, 1.0, 1.0, max_sync_every=5), "max_sync_every=5"),
        (lambda: adapt(4, 10, 1.0, 1.0, min_sync_every=20), "min_sync_every=20"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), rank=0), "rank=0"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), factors="int8"), "factors='int8'"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), delay=-1), "delay=-1"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), block=7), "block=7"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), decay=1.5), "decay=1.5"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), seed=-1), "seed=-1"),
        (lambda: co2jax.diloco_x(optax.sgd(1.0), skip_nonfinite="yes"), "skip_nonfinite='yes'"),
        (lambda: co2jax.diloco_x("sgd"), "outer_optimizer="),
        (lambda: co2jax.low_rank("diloco", 2), "outer='diloco'"),
        (
            lambda: co2jax.low_rank(
                co2jax.diloco(optax.sgd(1.0), reduce=cx.all_gather_compressed(cx.int8())), 2
            ),
            "all_gather_compressed",
        ),
        (lambda: cx.int4(block=3), "block=3"),
        (
            lambda: exchange_seconds(co2jax.JobMetrics(None, 1.0, 0.0, 1.0, 8), -1.0),
            "link_bytes_per_s=-1.0",
        ),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# int4


def _int4_numpy(x, block):
    """(packed uint8 [blocks, block/2], scale float32 [blocks]), in float32 like the codec."""
    n = x.size
    xb = np.pad(x.astype(np.float32), (0, (-n) % block)).reshape(-1, block)
    s = (np.abs(xb).max(axis=1) / np.float32(7.0)).astype(np.float32)
    q = np.clip(np.round(xb / np.where(s > 0, s, np.float32(1.0))[:, None]), -7, 7).astype(np.int64)
    nib = q & 15
    return (nib[:, : block // 2] | (nib[:, block // 2 :] << 4)).astype(np.uint8), s


@pytest.mark.parametrize("n", [1, 63, 64, 1000])
@pytest.mark.cases("first", 3)
def test_int4_matches_numpy_and_its_bounds(n):
    codec = cx.int4(block=64)
    rng = np.random.default_rng(n)
    x = (rng.normal(size=n) * rng.choice([1e-3, 1.0, 50.0], size=n)).astype(np.float32)
    x[:: max(1, n // 5)] = 0.0
    packed, scale = jax.jit(codec.encode)(jnp.asarray(x))
    want_packed, want_scale = _int4_numpy(x, 64)
    np.testing.assert_array_equal(np.asarray(packed), want_packed)
    # XLA may divide by the constant 7 as a multiplication by 1/7: one ulp apart
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=2e-7)
    assert packed.size + 4 * scale.size == codec.wire_bytes(n)  # two codes per byte
    got = np.asarray(codec.decode((packed, scale), n))
    np.testing.assert_array_equal(got[x == 0], 0.0)
    s = np.repeat(want_scale, 64)[:n]
    np.testing.assert_array_less(np.abs(got - x), s / 2 * (1 + 1e-6) + 1e-30)
    again = codec.encode(jnp.asarray(got))  # C(D(C(x))) == C(x)
    np.testing.assert_array_equal(np.asarray(again[0]), want_packed)
    np.testing.assert_allclose(np.asarray(again[1]), want_scale, rtol=1e-6)


def test_int4_ties_round_to_even():
    codec = cx.int4(block=8)  # s = 7 / 7 = 1: every x / s below is exact
    x = jnp.array([7.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -6.5])
    np.testing.assert_array_equal(codec.roundtrip(x), [7, 0, 2, 2, 0, -2, 4, -6])


def test_int4_zeros_registry_and_non_finite_blocks():
    codec = cx.make("int4")
    assert "int4" in cx.FORMATS and codec.block == 128 and codec.wire_bytes(128) == 68
    np.testing.assert_array_equal(codec.roundtrip(jnp.zeros(130)), 0.0)
    x = jnp.ones(256).at[3].set(jnp.nan).at[200].set(jnp.inf)
    got = np.asarray(codec.roundtrip(x.at[200].set(1.0)))
    assert np.isnan(got[:128]).all()  # a NaN poisons its own block only
    np.testing.assert_allclose(got[128:], 1.0, rtol=1e-6)
    assert np.isnan(np.asarray(codec.roundtrip(x))).all()


@pytest.mark.parametrize("collective", ["all_gather", "two_step"])
def test_int4_through_the_registry(collective):
    """outer.compression=int4 builds with either collective and error feedback, runs close to
    uncompressed DiLoCo, and a delayed algorithm's int4 payload cut into chunks (the adapter's
    default spread) reduces to what the round-level sync gives."""
    from co2jax.algorithms import registry

    problem = tb.make_problem(replicas=4, examples=2, dim=300, seed=1)
    settings = registry.settings(
        "delayed_diloco", learning_rate=0.5, momentum=0.5, compression="int4",
        error_feedback=True, collective=collective,
    )  # fmt: skip
    build = lambda: settings.validate().outer(registry.Context(sync_every=H))
    got, _ = harness.run_vmap(build(), problem, LR, H, ROUNDS)
    plain = tb.diloco_nesterov(problem, LR, H, ROUNDS, 0.5, 0.5, delay=1)
    off, moved = np.abs(got - plain).max(), np.abs(plain - problem.theta0).max()
    assert 1e-6 < off < 0.1 * moved  # quantized, and within a tenth of how far the run went
    if collective == "all_gather":
        spread = harness.run_adapter(build(), optax.sgd(LR), problem, H, ROUNDS)
        np.testing.assert_allclose(spread, got, **TOL)
