"""The round engine: equal to the textbook loops and the per-step adapter, on a mesh."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from jax.sharding import AxisType
from test_algorithms import CASES, IDS

import co2jax
from co2jax import overlap

LR, H, ROUNDS = 0.1, 3, 5
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def engine_loss(params, batch):
    """The textbook problem's loss on one device's slice of examples."""
    theta = harness.flatten(params)
    return jnp.mean(0.5 * jnp.sum(batch["d"] * (theta - batch["c"]) ** 2, axis=-1))


def textbook_batch(problem: tb.Problem, steps: int = H) -> dict:
    """[R, H, K, dim] leaves: every inner step sees the replica's K examples."""
    R, K, dim = problem.c.shape
    c = np.broadcast_to(problem.c[:, None], (R, steps, K, dim))
    d = np.broadcast_to(problem.d[:, None, None], (R, steps, K, dim))
    return {"c": jnp.asarray(c, jnp.float32), "d": jnp.asarray(d, jnp.float32)}


def run_engine(outer, problem, mesh, rounds=ROUNDS, inner=None, **kw):
    trainer = co2jax.RoundTrainer(
        engine_loss, inner or optax.sgd(LR), outer, mesh, sync_every=H, **kw
    )
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    batch = textbook_batch(problem)
    out, metrics = [], []
    for _ in range(rounds):
        state, m = trainer.round(state, batch)
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
        metrics.append(m)
    return np.stack(out), state, metrics, trainer


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2)


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 5)
def test_engine_matches_textbook(case, problem, mesh):
    got, state, _, trainer = run_engine(case.make(), problem, mesh)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)
    assert trainer.program(state).fn._cache_size() == 1  # one program for every round
    np.testing.assert_array_equal(state.round, [ROUNDS] * 4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 4)
def test_sharded_outer_state_matches_textbook(case, problem, mesh):
    """The outer state sharded over data (1/D per device) changes no value."""
    got, state, _, _ = run_engine(case.make(), problem, mesh, shard_outer_state=True)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)
    anchor = state.outer_state.anchor
    # "b" has 2 elements: split over data=2; "w" has 3: kept whole
    assert anchor["b"].sharding.shard_shape(anchor["b"].shape) == (1, 1)
    assert anchor["w"].sharding.shard_shape(anchor["w"].shape) == (1, 3)


@pytest.mark.parametrize("reducer", ["pmean", "all_gather", "ring", "outer"])
@pytest.mark.parametrize("name", ["co2", "eager_diloco", "diloco"])
@pytest.mark.cases("algorithms", 2)
def test_every_reducer_gives_the_same_trajectory(reducer, name, problem, mesh):
    case = next(c for c in CASES if c.name == name)
    got, *_ = run_engine(case.make(), problem, mesh, reducer=reducer)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)


def test_auto_axis_types(problem):
    mesh = co2jax.make_mesh(
        replica=4, data=2, devices=jax.devices("cpu")[:8], axis_type=AxisType.Auto
    )
    case = next(c for c in CASES if c.name == "co2_clip")
    got, *_ = run_engine(case.make(), problem, mesh)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 2)
def test_engine_equals_per_step_adapter(case, problem, mesh):
    """Adam inner state persists in both; round engine == local_updates, step by step."""
    got, *_ = run_engine(case.make(), problem, mesh, rounds=3, inner=optax.adam(0.05))
    want, _ = harness.run_vmap(case.make(), problem, 0.05, H, 3, inner=optax.adam(0.05))
    np.testing.assert_allclose(got, want, **TOL)


def test_metrics(problem, mesh):
    outer = co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True))
    _got, _state, metrics, _trainer = run_engine(outer, problem, mesh, rounds=1)
    m = metrics[0]
    assert m.loss.shape == (4, H)
    assert np.all(np.diff(np.asarray(m.loss), axis=1) < 0)  # SGD on a quadratic descends
    # the payload is Delta_r = theta0 - theta_r after H inner steps
    local = np.stack([tb.inner_sgd(problem, r, problem.theta0, LR, H) for r in range(4)])
    np.testing.assert_allclose(
        m.pseudo_gradient_norm, np.linalg.norm(problem.theta0 - local, axis=1), **TOL
    )
    deltas = problem.theta0 - local
    mean = deltas.mean(axis=0)
    cosine = deltas @ mean / (np.linalg.norm(deltas, axis=1) * np.linalg.norm(mean))
    np.testing.assert_allclose(m.cosine_to_mean, cosine, **TOL)
    payload_bytes = 5 * 4  # five float32 parameters
    np.testing.assert_allclose(m.bytes_communicated, 2 * 3 / 4 * payload_bytes)


def test_sharded_metrics_equal_unsharded(problem, mesh):
    outer = lambda: co2jax.co2(1.0, 0.5)
    *_, plain, _ = run_engine(outer(), problem, mesh, rounds=2)
    *_, sharded, _ = run_engine(outer(), problem, mesh, rounds=2, shard_outer_state=True)
    for a, b in zip(plain, sharded, strict=True):
        np.testing.assert_allclose(a.pseudo_gradient_norm, b.pseudo_gradient_norm, **TOL)
        np.testing.assert_allclose(a.cosine_to_mean, b.cosine_to_mean, **TOL)
        np.testing.assert_allclose(a.bytes_communicated, b.bytes_communicated)


# ---------------------------------------------------------------------------------------------
# communication structure


def _placed(trainer, problem):
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    return state, trainer.place_batch(textbook_batch(problem))


@pytest.mark.parametrize("reducer", ["pmean", "all_gather", "ring"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 13)
def test_delayed_reduction_is_independent_of_the_inner_loop(case, reducer, problem, mesh):
    outer = case.make()
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H, reducer=reducer)
    state, batch = _placed(trainer, problem)
    report = overlap.overlap_report(trainer.program(state).fn, state, batch)
    assert report.in_loop == 0, "inner steps must not communicate over the replica axis"
    assert report.loops == 1 and report.collectives >= 1
    if outer.overlapped:
        assert report.independent, report
    else:  # a synchronous sync must wait for the loop: the checker sees that
        assert report.after_loop == report.collectives and not report.independent


def test_round_hlo_has_one_replica_reduction_outside_the_loop(problem, mesh):
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), co2jax.co2(1.0, 0.5), mesh, H)
    state, batch = _placed(trainer, problem)
    text = trainer.program(state).fn.lower(state, batch).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "replica")
    assert sum(c.elements for c in found) == 5
    assert all(c.computation.startswith("main") for c in found)  # none in an inner step
    data = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "data")
    in_loop = [c for c in data if not c.computation.startswith("main")]
    # one reduction over data per inner step: the gradients and the loss, combined
    assert [c.op for c in in_loop] == ["all-reduce"] and in_loop[0].elements == 5 + 1, in_loop


@pytest.mark.parametrize("layout", ["whole", "shard_outer_state"])
def test_a_layer_scanned_model_reduces_its_gradient_once_per_step(layout, mesh):
    """A model that scans over its layers (as the benchmarks' and real models do): the
    gradient is averaged over data once per inner step, after the backward pass, not layer
    by layer inside the backward loop (which kept 2.2x the temp memory on TPU,
    co2jax/engines/gradients.py)."""
    layers, d = 3, 8

    def loss(p, b):
        def block(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(block, b["x"], p["w"])
        return jnp.mean((h - b["y"]) ** 2)

    kw = {} if layout == "whole" else {"shard_outer_state": True}
    trainer = co2jax.RoundTrainer(loss, optax.adamw(1e-3), co2jax.co2(0.7, 0.5), mesh, H, **kw)
    state = trainer.init({"w": 0.1 * jnp.ones((layers, d, d))})
    x = jax.random.normal(jax.random.key(0), (4, H, 4, d))
    batch = trainer.place_batch({"x": x, "y": jnp.tanh(x)})
    text = trainer.program(state).fn.lower(state, batch).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "data")
    reductions = [c for c in found if c.op == "all-reduce" and not c.computation.startswith("main")]
    assert len(reductions) == 1 and reductions[0].elements == layers * d * d + 1, reductions


# ---------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs(problem, mesh):
    outer = co2jax.local_sgd()
    with pytest.raises(ValueError, match="sync_every=0"):
        co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, 0)
    with pytest.raises(ValueError, match="reducer='tree'"):
        co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H, reducer="tree")
    flat = jax.make_mesh((8,), ("x",), devices=jax.devices("cpu")[:8])
    with pytest.raises(ValueError, match="mesh must have axes"):
        co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, flat, H)
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    batch = textbook_batch(problem)
    trainer.round(state, batch)  # checked once per shapes: the bad ones below still raise
    with pytest.raises(ValueError, match=r"\['c'\] has shape \(4, 2, 2, 5\)"):
        trainer.round(state, {**batch, "c": batch["c"][:, :2]})
    with pytest.raises(ValueError, match="multiple of the data axis size 2"):
        trainer.round(state, jax.tree.map(lambda x: x[:, :, :1], batch))
    with pytest.raises(ValueError, match=r"\[replica, H, batch"):
        trainer.round(state, {"c": jnp.ones((4, 3)), "d": batch["d"]})
    vector_loss = co2jax.RoundTrainer(
        lambda p, b: harness.flatten(p) * b["c"], optax.sgd(LR), outer, mesh, H
    )
    vector_state = vector_loss.init(harness.unflatten(jnp.zeros(5)))
    for _ in range(2):  # a refused batch is not remembered as checked
        with pytest.raises(ValueError, match="loss_fn must return a scalar"):
            vector_loss.round(vector_state, batch)


@pytest.mark.parametrize(
    "sizes, match",
    [
        (dict(replica=3, data=-1), "does not divide"),
        (dict(replica=2, data=2), "multiply to 4, but there are 8"),
        (dict(replica=-1, data=-1), "at most one"),
        (dict(replica=0, data=-1), "replica=0"),
    ],
)
def test_make_mesh_errors(sizes, match):
    with pytest.raises(ValueError, match=match):
        co2jax.make_mesh(**sizes, devices=jax.devices("cpu")[:8])


def test_ddp_through_the_engine(problem, mesh):
    """data_parallel inner + no_sync outer: synchronous SGD, one replica all-reduce per step."""
    got, *_ = run_engine(co2jax.no_sync(), problem, mesh, inner=co2jax.data_parallel(optax.sgd(LR)))
    np.testing.assert_allclose(got, tb.data_parallel_sgd(problem, LR, H, ROUNDS), **TOL)


def test_auto_reducer_policy():
    auto = co2jax.comm.policy.auto_kind
    assert auto("cpu", 4, True) == auto("gpu", 4, True) == "pmean"
    assert auto("tpu", 4, False) == "pmean"  # a synchronous sync overlaps nothing
    assert auto("tpu", 2, True, 1_000_000) == "all_gather"
    assert auto("tpu", 8, True, 1_000_000) == "ring"  # all-gather traffic grows with R
    limit = co2jax.comm.policy.ALL_GATHER_LIMIT
    assert auto("tpu", 2, True, limit // 8) == "all_gather"
    assert auto("tpu", 2, True, limit // 8 + 1) == "ring"  # R float32 copies would not fit


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 4)
def test_fsdp_matches_textbook(case, problem, mesh):
    """Parameters, inner and outer state sharded over data: the same trajectory."""
    got, state, _, _ = run_engine(case.make(), problem, mesh, fsdp=True)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)
    params, anchor = state.params, state.outer_state.anchor
    assert params["b"].sharding.shard_shape(params["b"].shape) == (1, 1)  # split over data
    assert params["w"].sharding.shard_shape(params["w"].shape) == (1, 3)  # 3 % 2: whole
    assert anchor["b"].sharding.shard_shape(anchor["b"].shape) == (1, 1)


def test_fsdp_with_adam_equals_unsharded(problem, mesh):
    outer = lambda: co2jax.co2(1.0, 0.5, clip_threshold=0.1)
    plain, *_ = run_engine(outer(), problem, mesh, rounds=3, inner=optax.adamw(0.05))
    sharded, state, _, _ = run_engine(
        outer(), problem, mesh, rounds=3, inner=optax.adamw(0.05), fsdp=True
    )
    np.testing.assert_allclose(sharded, plain, **TOL)
    mu = state.inner_state[0].mu["b"]
    assert mu.sharding.shard_shape(mu.shape) == (1, 1)  # AdamW's moments are sharded too


def test_fsdp_round_keeps_the_replica_axis_out_of_the_loop(problem, mesh):
    trainer = co2jax.RoundTrainer(
        engine_loss, optax.adamw(LR), co2jax.co2(1.0, 0.5), mesh, H, fsdp=True
    )
    state, batch = _placed(trainer, problem)
    report = overlap.overlap_report(trainer.program(state).fn, state, batch)
    assert report.in_loop == 0 and report.independent, report
    text = trainer.program(state).fn.lower(state, batch).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "data")
    in_loop = {c.op for c in found if not c.computation.startswith("main")}
    # the compiler's FSDP: the split parameters gathered for the step, the gradients reduced
    # (XLA:CPU reduces with an all-reduce and keeps its shard; TPU and GPU reduce-scatter)
    assert "all-gather" in in_loop and in_loop & {"all-reduce", "reduce-scatter"}, in_loop
    shard = lambda x: x.sharding.shard_shape(x.shape)
    assert shard(state.params["b"]) == (1, 1)  # the parameters themselves stay split


# ---------------------------------------------------------------------------------------------
# the fused outer update on the engine's path


FUSED_ENGINE = {
    "co2_gap_aware": lambda impl: co2jax.co2(
        0.8, 0.5, clip_threshold=0.1, penalty=co2jax.penalties.gap_aware(0.9), implementation=impl
    ),
    "co2_guarded": lambda impl: co2jax.skip_nonfinite(
        co2jax.co2(1.0, 0.5, clip_threshold=0.1, implementation=impl)
    ),
    "eager_diloco": lambda impl: co2jax.eager_diloco(
        co2jax.outer_sgd(0.7, 0.9, nesterov=True), implementation=impl
    ),
}


# The guard's shard agreement reads shard_map's varying-axis types, which the interpreter's
# check_vma=False turns off: the guard is run on whole outer state only.
GATHERED_CASES = [
    (name, sharded)
    for name in FUSED_ENGINE
    for sharded in (False, True)
    if not (name == "co2_guarded" and sharded)
]


@pytest.mark.parametrize(
    "name, shard_outer_state",
    GATHERED_CASES,
    ids=[f"{n}-{'sharded' if s else 'whole'}" for n, s in GATHERED_CASES],
)
@pytest.mark.cases("first", 2)
def test_gathered_payloads_reach_the_kernel(name, shard_outer_state, problem, mesh):
    """reducer="all_gather": the R payloads go un-reduced into the fused kernel (Pallas'
    interpreter), which averages them in its own pass; same trajectory and metrics as the
    all-reduce followed by the jnp update."""
    kw = dict(shard_outer_state=shard_outer_state)
    want, _, want_m, _ = run_engine(FUSED_ENGINE[name]("xla"), problem, mesh, reducer="pmean", **kw)
    got, state, got_m, trainer = run_engine(
        FUSED_ENGINE[name]("interpret"), problem, mesh, reducer="all_gather", check_vma=False, **kw
    )
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(got_m, want_m, strict=True):
        np.testing.assert_allclose(a.cosine_to_mean, b.cosine_to_mean, rtol=1e-5)
        np.testing.assert_allclose(a.pseudo_gradient_norm, b.pseudo_gradient_norm, rtol=1e-5)
    batch = trainer.place_batch(textbook_batch(problem))
    jaxpr = str(jax.make_jaxpr(trainer.program(state).fn)(state, batch))
    assert "co2jax_outer_update" in jaxpr  # the kernel is on the round's path
    text = trainer.lower(state, batch).compile().as_text()
    found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "replica")
    assert {c.op for c in found} == {"all-gather"}, found  # no separate all-reduce mean


@pytest.mark.parametrize("layout", ["shard_outer_state", "fsdp"])
@pytest.mark.parametrize("name", ["co2", "local_sgd", "eager_diloco"])
@pytest.mark.cases("algorithms", 2)
def test_all_gather_with_split_outer_state_under_check_vma(name, layout, problem, mesh):
    """The all-gather reducers (the stacked one for the fused update, here on its jnp path)
    with the outer state split over data and a leaf that cannot be ("w": 3 elements over
    data=2), under shard_map's varying-axis check: each group of leaves is gathered on its
    own, so the whole leaf stays data-invariant. Before the fix the round did not build (its
    whole leaf came back typed as varying over data). The check is on here: this is the twin
    of the interpreter tests that must turn it off."""
    case = next(c for c in CASES if c.name == name)
    got, state, _, trainer = run_engine(
        case.make(), problem, mesh, reducer="all_gather", **{layout: True}
    )
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)
    assert trainer.program(state).reducer_kind == "all_gather" and trainer._check_vma
    anchor = state.outer_state.anchor
    assert anchor["b"].sharding.shard_shape(anchor["b"].shape) == (1, 1)  # split over data
    assert anchor["w"].sharding.shard_shape(anchor["w"].shape) == (1, 3)  # whole


SPREAD_CASES = [c for c in CASES if c.make().overlapped]


@pytest.mark.parametrize("layout", ["whole", "shard_outer_state"])
@pytest.mark.parametrize("reducer", ["pmean", "all_gather", "staged"])
@pytest.mark.parametrize("case", SPREAD_CASES, ids=[c.name for c in SPREAD_CASES])
@pytest.mark.cases("first", 9)
def test_spread_round_equals_unspread(case, reducer, layout, problem, mesh):
    """A delayed payload cut into a chunk per inner step, each reduced inside its iteration,
    gives the unspread round (same reducer kind). The reduced values are equal bit for bit
    (tests/test_chunks.py); the two programs are compiled apart, so XLA may contract the outer
    update's arithmetic differently (FMA): one float32 ulp is allowed."""
    kw = {} if layout == "whole" else {"shard_outer_state": True}
    plain, s0, plain_m, t0 = run_engine(
        case.make(), problem, mesh, reducer=reducer, spread=False, **kw
    )
    got, s1, got_m, t1 = run_engine(case.make(), problem, mesh, reducer=reducer, spread=H, **kw)
    assert t0.program(s0).transfers[0].chunks == 1 and t1.program(s1).transfers[0].chunks == H
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_m, plain_m, strict=True):
        np.testing.assert_allclose(a.pseudo_gradient_norm, b.pseudo_gradient_norm, rtol=1e-6)
        np.testing.assert_allclose(a.cosine_to_mean, b.cosine_to_mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, case.textbook(problem), **TOL)


@pytest.mark.parametrize("layout", ["whole", "shard_outer_state"])
@pytest.mark.parametrize("case", SPREAD_CASES[:2], ids=[c.name for c in SPREAD_CASES[:2]])
@pytest.mark.cases("first", 2)
def test_spread_in_rows_equals_unspread(case, layout, problem, mesh, monkeypatch):
    """Chunks cut in rows (the layout of real models' groups, here forced on the small
    problem with rows of 2): the spread round still equals the unspread one."""
    from co2jax.comm import chunks

    kw = {} if layout == "whole" else {"shard_outer_state": True}
    plain, *_ = run_engine(case.make(), problem, mesh, reducer="all_gather", spread=False, **kw)
    monkeypatch.setattr(chunks, "LANES", 2)
    monkeypatch.setattr(chunks, "MIN_ROWS", 0)
    got, state, _, trainer = run_engine(
        case.make(), problem, mesh, reducer="all_gather", spread=H, **kw
    )
    assert trainer.program(state).transfers[0].chunks == H
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)


def _compressed(codec, ef: bool):
    from co2jax import comm

    outer = co2jax.co2(1.0, 0.5, reduce=comm.all_gather_compressed(codec))
    return co2jax.error_feedback(outer, decay=0.9) if ef else outer


SPLIT_CASES = {c.name: c.make for c in SPREAD_CASES[:3]} | {
    "int8": lambda: _compressed(co2jax.comm.int8(block=2), False),
    "int8_error_feedback": lambda: _compressed(co2jax.comm.int8(block=2), True),
    "topk_error_feedback": lambda: _compressed(co2jax.comm.topk(1, chunk=2), True),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
@pytest.mark.cases("first", 1)
def test_split_payload_equals_whole_payload_and_crosses_the_replica_axis_once(name):
    """Each of a replica's 4 devices (data 2 x model 2) sends its slice of every chunk: the
    same rounds as whole chunks (the slow twin,
    split_payload=False), exact means and codecs (blocks of 2 quantized or top-1 selected
    on their own, error feedback with its residual) alike, with at most 1/2.5 of the
    per-device bytes on the replica axis (13 parameters: a chunk of 5 padded to 8, 2 a
    device; int8 blocks of 2: 3 a chunk padded to 4, one a device)."""
    problem = tb.make_problem(replicas=2, examples=2, dim=13)
    mesh = co2jax.make_mesh(replica=2, data=2, model=2, devices=jax.devices("cpu")[:8])
    runs, moved = [], []
    for split in (False, True):
        got, state, _, trainer = run_engine(
            SPLIT_CASES[name](), problem, mesh, spread=H, split_payload=split
        )
        assert trainer.program(state).plan.shards == (4 if split else 1)
        text = trainer.lower(state, trainer.place_batch(textbook_batch(problem)))
        found = co2jax.hlo.flights(text.compile().as_text(), mesh, "replica")
        assert found and all(f.count == H for f in found), found
        runs.append(got)
        moved.append(sum(f.sent * f.count for f in found))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6, atol=1e-7)
    if name in (c.name for c in SPREAD_CASES):
        case = next(c for c in SPREAD_CASES if c.name == name)
        np.testing.assert_allclose(runs[1], case.textbook(problem), **TOL)
    assert moved[1] * 2.5 <= moved[0], moved


def test_split_payload_is_checked(mesh):
    with pytest.raises(
        ValueError, match="split_payload must be True or False, got split_payload=1"
    ):
        co2jax.RoundTrainer(
            engine_loss, optax.sgd(LR), co2jax.co2(1.0, 0.5), mesh, H, split_payload=1
        )


def test_spread_compressed_and_error_feedback_equal_unspread(problem, mesh):
    """int8 blocks are never split by a chunk, and error feedback's encodings are cut along
    their blocks: spread equals unspread."""
    from co2jax import comm

    def make():
        reduce = comm.all_gather_compressed(comm.int8(block=2))
        return co2jax.error_feedback(co2jax.co2(1.0, 0.5, reduce=reduce))

    plain, *_ = run_engine(make(), problem, mesh, spread=False)
    got, *_ = run_engine(make(), problem, mesh, spread=H)
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)


def test_spread_chunks_sit_inside_the_loop(problem, mesh):
    """The spread round's replica-axis collectives are inside the loop body, one chunk per
    iteration; the unspread one issues its reduction outside the loop."""
    outer = co2jax.co2(1.0, 0.5)
    for spread, inside in [(H, True), (False, False)]:
        trainer = co2jax.RoundTrainer(
            engine_loss, optax.sgd(LR), outer, mesh, H, reducer="all_gather", spread=spread
        )
        state, batch = _placed(trainer, problem)
        text = trainer.lower(state, batch).compile().as_text()
        found = co2jax.hlo.flights(text, mesh, "replica")
        assert found and all((f.count == H) == inside for f in found), found


def test_spread_argument_is_checked(mesh):
    with pytest.raises(ValueError, match="spread=0"):
        co2jax.RoundTrainer(engine_loss, optax.sgd(LR), co2jax.co2(1.0, 0.5), mesh, H, spread=0)


def test_init_refuses_parameters_that_carry_a_replica_axis(problem, mesh):
    """``init`` takes one replica's parameters: handing it a state's stacked parameters (one
    copy per replica, split over the replica axis) is refused with one line, not stacked a
    second time."""
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), co2jax.local_sgd(), mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    with pytest.raises(ValueError, match=r"init takes one replica's parameters.*params\['b'\]"):
        trainer.init(state.params)
