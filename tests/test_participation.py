"""Participation weights: weighted reductions, masked rounds of the round engine against
textbook loops, and per-replica step counts (co2jax.comm.participation)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax import comm
from co2jax.algorithms import registry

LR, H, ROUNDS = 0.1, tb.REGISTERED_H, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def _gather_forms():
    """Every reducer with a gather form, as (name, reducer)."""
    return [
        ("all_gather", comm.all_gather_mean()),
        ("pmean", comm.pmean()),
        ("stacked", comm.all_gather_stacked()),
        ("stacked_int8", comm.all_gather_stacked(quantize="int8")),
        ("int8", comm.all_gather_compressed(comm.int8(block=8))),
        ("int4", comm.all_gather_compressed(comm.int4(block=8))),
        ("topk_contributors", comm.all_gather_topk(3, chunk=8)),
        ("production", comm.all_gather_topk_quantized(4, chunk=8)),
        ("production_replicas", comm.all_gather_topk_quantized(4, chunk=8, average="replicas")),
        ("dct", comm.all_gather_dct_topk(3, chunk=8)),
    ]


FORMS = _gather_forms()


@pytest.mark.parametrize("name, reducer", FORMS, ids=[n for n, _ in FORMS])
@pytest.mark.cases("first", 2)
def test_a_weighted_combine_is_the_subset_combine(name, reducer):
    """0/1 weights == the reducer's own combine of the participants alone; all-equal weights
    == the unweighted combine; integer weights == each replica repeated that often (except
    the production clip's median, which counts each participant once)."""
    R = 5
    key = jax.random.key(3)
    payloads = [
        {"a": jax.random.normal(jax.random.fold_in(key, r), (16,)) * (r + 1),
         "m": jax.random.normal(jax.random.fold_in(key, 10 + r), (8, 8))}
        for r in range(R)
    ]  # fmt: skip
    encoded = [reducer.encode(p) for p in payloads]
    stack = lambda idx: jax.tree.map(lambda *xs: jnp.stack(xs), *[encoded[i] for i in idx])
    every = stack(range(R))
    close = lambda a, b: jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(jnp.asarray(x, jnp.float32)), np.asarray(y, np.float32), **TOL
        ),
        a,
        b,
    )
    values = jax.jit(lambda x: co2jax.comm.values(x.combine()))
    weighted = jax.jit(lambda x, w: x.combine(w))
    close(weighted(every, jnp.full((R,), 2.5)), values(every))
    mask = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0])
    close(weighted(every, mask), values(stack([0, 2, 3])))
    assert not np.allclose(np.asarray(weighted(every, mask)["a"]), np.asarray(values(every)["a"]))
    if not name.startswith("production"):
        counts = jnp.array([2.0, 1.0, 0.0, 3.0, 1.0])
        repeated = [0, 0, 1, 3, 3, 3, 4]
        close(weighted(every, counts), values(stack(repeated)))


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_weighted_exact_mean_under_vmap_and_shard_map():
    x = jnp.arange(8.0 * 3).reshape(8, 3) ** 1.5
    w = jnp.array([1.0, 0.0, 2.0, 1.0, 0.0, 3.0, 1.0, 1.0])
    want = np.sum(np.asarray(w)[:, None] * np.asarray(x), 0) / float(w.sum())
    for reducer in (comm.pmean(), comm.all_gather_mean(), comm.ring_mean()):
        got = jax.vmap(lambda x, w, r=reducer: comm.weighted(r, w)(x), axis_name="replica")(x, w)
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), **TOL)
    mesh = co2jax.make_mesh(replica=8, data=1, devices=jax.devices("cpu")[:8])
    P = jax.sharding.PartitionSpec
    place = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("replica")))
    for reducer in (comm.pmean(), comm.all_gather_mean()):
        fn = jax.shard_map(
            lambda x, w, r=reducer: comm.weighted(r, w[0])(x),
            mesh=mesh,
            in_specs=(P("replica"), P("replica")),
            out_specs=P("replica"),
        )
        np.testing.assert_allclose(fn(place(x), place(w)), np.broadcast_to(want, (8, 3)), **TOL)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_left_out_nan_does_not_reach_the_mean():
    x = jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf], [3.0, 4.0]])
    for reducer in (comm.pmean(), comm.all_gather_compressed(comm.int8(block=8))):
        fn = lambda x, w, r=reducer: comm.weighted(r, w)(x)
        got = jax.vmap(fn, axis_name="replica")(x, jnp.array([1.0, 0.0, 1.0]))
        np.testing.assert_allclose(got[0], [2.0, 3.0], rtol=1e-2)
        auto = lambda x, r=reducer: comm.weighted(r, 1.0, exclude_nonfinite=True)(x)
        np.testing.assert_allclose(jax.vmap(auto, axis_name="replica")(x)[2], [2.0, 3.0], rtol=1e-2)


def test_reducers_without_a_weighted_form_are_refused():
    with pytest.raises(ValueError, match="reducer='all_reduce_compressed"):
        comm.weighted(comm.all_reduce_compressed(comm.int8()), 1.0)


# ------------------------------------------------------------------------------------------
# the round engine


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, dim=16, seed=5)


def _engine(name, problem, mesh, rounds, **part):
    outer, inner = harness.registered(name, problem, LR, H)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for t in range(rounds):
        kw = {k: v[t] for k, v in part.items()}
        state, _ = trainer.round(state, textbook_batch(problem, H), **kw)
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out)


def _subset(problem, idx):
    return tb.Problem(problem.d[list(idx)], problem.c[list(idx)], problem.theta0)


def _maskable(name: str) -> bool:
    """An outer reduction, a replica-invariant anchor and an inner transform that does not
    communicate (what participation needs)."""
    outer, _ = harness.registered(name, tb.make_problem(replicas=4, dim=16), LR, H)
    algorithm = tb.VARIANTS[name][0] if name in tb.VARIANTS else name
    every_step = registry.capabilities(algorithm).every_step
    return bool(outer.schedule) and not outer.replica_local and not every_step


NAMES = (*registry.NAMES, *tb.VARIANTS)
MASKABLE = [n for n in NAMES if _maskable(n)]
REFUSED = [n for n in NAMES if not _maskable(n)]


# one of each kind in the default suite (synchronous, delayed, fragments, compressed with
# error feedback, the production quantizer, low-rank); every other with -m slow
_QUICK = {"diloco", "co2", "streaming_diloco", "sparseloco", "sparseloco[production]", "diloco_x"}


@pytest.mark.parametrize(
    "name", [n if n in _QUICK else pytest.param(n, marks=pytest.mark.slow) for n in MASKABLE]
)
@pytest.mark.cases("algorithms", 6)
def test_a_replica_left_out_every_round_is_the_textbook_loop_without_it(name, problem, mesh):
    """Every registered algorithm with a replica-invariant anchor: replica 1 left out of
    every round == the textbook loop on replicas {0, 2, 3}; and integer weights (2, 1, 0, 1)
    == the loop with replica 0 twice and replica 2 absent (the production clip counts each
    participant once: its weights are checked by the mask only)."""
    loop = tb.loop_of(name)
    got = _engine(name, problem, mesh, ROUNDS, weights=[[1, 0, 1, 1]] * ROUNDS)
    want = loop(_subset(problem, [0, 2, 3]), LR, H, ROUNDS)
    np.testing.assert_allclose(got[:, [0, 2, 3]], want, **TOL)
    if name not in ("sparseloco[production]",):
        got = _engine(name, problem, mesh, ROUNDS, weights=[[2, 1, 0, 1]] * ROUNDS)
        want = loop(_subset(problem, [0, 0, 1, 3]), LR, H, ROUNDS)
        np.testing.assert_allclose(got[:, [0, 1, 3]], want[:, [0, 2, 3]], **TOL)


def test_replica_local_algorithms_and_inner_only_ones_refuse_weights(problem, mesh):
    every_step = {
        "ddp",
        "ddp[gpa]",
        "demo",
        "sparta",
        "sparta_diloco",
        "sparta[bernoulli]",
        "desloc",
    }
    assert {"eager_diloco", "noloco", "hierarchical_diloco", "dct_diloco", *every_step} == set(
        REFUSED
    )
    for name in REFUSED:
        outer, inner = harness.registered(name, problem, LR, H)
        trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
        state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
        why = r"replica-local anchors|needs an outer reduction|communicates over 'replica'"
        with pytest.raises(ValueError, match=why):
            trainer.round(state, textbook_batch(problem, H), weights=[1, 1, 0, 1])


@pytest.mark.parametrize(
    "weights, steps, match",
    [
        ([1, 1, 1], None, "weights must be 4 finite"),
        ([0, 0, 0, 0], None, "not all 0"),
        ([1, -1, 1, 1], None, "weights must be"),
        ([1, np.nan, 1, 1], None, "weights must be"),
        (None, [4, 4, 0, 4], r"steps must be 4 integers in 1..H=4"),
        (None, [4, 4, 5, 4], r"steps must be 4 integers"),
        (None, [4.0, 4, 2, 4], r"steps must be 4 integers"),
    ],
)
def test_bad_participation_is_refused_before_compute(problem, mesh, weights, steps, match):
    outer, inner = harness.registered("diloco", problem, LR, H)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    before = jax.device_get(state)
    with pytest.raises(ValueError, match=match):
        trainer.round(state, textbook_batch(problem, H), weights=weights, steps=steps)
    assert not trainer._programs  # nothing compiled, nothing run
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), before)


# masks that change every round: each one leaves a different replica out (or none)
MASKS = [[1, 0, 1, 1], [1, 1, 1, 0], [0.5, 1, 2, 1], [1, 1, 0, 0]]


def test_masked_rounds_match_the_textbook_loops(problem, mesh):
    """A mask per round (synchronous, delayed, streamed, compressed with error feedback)."""
    import textbook_masked as tm

    rounds = len(MASKS)
    cases = {
        "diloco": lambda: tm.diloco(problem, LR, H, rounds, 0.7, 0.9, MASKS),
        "delayed_diloco": lambda: tm.diloco(problem, LR, H, rounds, 0.5, 0.5, MASKS, delay=1),
        "streaming_diloco": lambda: tm.streaming(
            problem, LR, H, rounds, [[0, 1], list(range(2, 16))], 1, 0.5, 0.7, 0.9, MASKS
        ),
        "sparseloco": lambda: tm.sparseloco(problem, LR, H, rounds, 1.0, 0.95, 4, 8, MASKS),
    }
    for name, loop in cases.items():
        got = _engine(name, problem, mesh, rounds, weights=MASKS)
        want = loop()
        # a left-out replica's own parameters (Streaming DiLoCo mixes them) are checked too
        np.testing.assert_allclose(got, want, **TOL, err_msg=name)
        unmasked = tb.loop_of(name)(problem, LR, H, rounds)
        assert np.abs(want[-1] - unmasked[-1]).max() > 1e-3, name  # the masks matter


def test_per_replica_steps_weigh_by_tokens(problem, mesh):
    """Replica r takes n[t][r] of the H steps; without weights each weighs its steps."""
    import textbook_masked as tm

    steps = [[4, 2, 1, 3], [1, 4, 4, 2], [3, 3, 1, 4]]
    got = _engine("diloco", problem, mesh, 3, steps=steps)
    np.testing.assert_allclose(
        got, tm.diloco(problem, LR, H, 3, 0.7, 0.9, steps, steps=steps), **TOL
    )
    masked = [[1, 0, 1, 1]] * 3  # explicit weights override the step counts
    got = _engine("diloco", problem, mesh, 3, steps=steps, weights=masked)
    np.testing.assert_allclose(
        got, tm.diloco(problem, LR, H, 3, 0.7, 0.9, masked, steps=steps), **TOL
    )


def test_nonfinite_payloads_are_left_out_when_asked(problem, mesh):
    """exclude_nonfinite: a replica whose pseudo-gradient is NaN (a poisoned batch) is left
    out of that round, as a mask would; the others' round is the masked loop's."""
    import textbook_masked as tm

    outer, inner = harness.registered("diloco", problem, LR, H)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite=True)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    batch = textbook_batch(problem, H)
    poisoned = {**batch, "d": batch["d"].at[1, 2].set(jnp.nan)}
    state, _ = trainer.round(state, poisoned)
    got = np.asarray(harness.flatten(jax.device_get(state.params)), np.float64)
    want = tm.diloco(problem, LR, H, 1, 0.7, 0.9, [[1, 0, 1, 1]])[0]
    np.testing.assert_allclose(got, want, **TOL)
