"""Error feedback through the two-step compressed all-reduce (docs/compression.md): what a
replica transmits is exactly what error feedback encoded, ``c = D(C(t))`` in the reducer's own
block layout, so the only error error feedback does not see is the documented second
quantization (of the mean). Parameters and residuals after several rounds against the numpy
loop (tests/textbook_two_step.py), for every block codec at R = 3, 4 and 8 with sizes that are not
multiples of R blocks: under vmap, under shard_map (the engines' replica map, and a manual
``data`` axis whose leaf shards are encoded on their own), spread in chunks by the per-step
adapter, and MuLoCo's defaults."""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_two_step as ts
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import comm
from co2jax.algorithms.error_feedback import ErrorFeedbackState

ETA, MU, DECAY, SCALE, ROUNDS = 0.7, 0.5, 0.9, 0.8, 4
TOL = harness.TOL[jnp.dtype(jnp.float32)]
# a residual t - c is a difference of two float32 values of the target's size (up to ~10)
RESIDUAL_TOL = dict(rtol=1e-5, atol=1e-5)


def _outer(fmt, block, delay=None):
    reduce = comm.all_reduce_compressed(comm.make(fmt, block=block))
    step = co2jax.outer_sgd(ETA, MU, nesterov=True)
    if delay is None:
        outer = co2jax.diloco(step, reduce=reduce)
    else:
        outer = co2jax.delayed_diloco(step, delay, reduce=reduce)
    return co2jax.error_feedback(outer, DECAY, SCALE)


def _deltas(R, n, seed=0):
    """Each round's pseudo-gradients ``[ROUNDS, R, n]`` (replicas of different sizes) and the
    start ``theta0``, float32."""
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.2, 3.0, size=(ROUNDS, R, 1))
    deltas = (rng.normal(size=(ROUNDS, R, n)) * scales).astype(np.float32)
    return deltas, rng.normal(size=n).astype(np.float32)


def _residuals(state) -> np.ndarray:
    """The (only) error feedback residual in ``state``, flattened: ``[R, n]``."""
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ErrorFeedbackState))
        if isinstance(x, ErrorFeedbackState)
    ]
    assert len(found) == 1, found
    return np.asarray(harness.flatten(found[0].residuals[0]), np.float64)


def _rounds(sync, outer, deltas, theta0, place=lambda x: x):
    """Round t starts every replica at the anchor and ends it at ``anchor - deltas[t]``:
    the anchors after each round ``[ROUNDS, R, n]`` and the last residuals ``[R, n]``."""
    R = deltas.shape[1]
    anchor = jnp.broadcast_to(jnp.asarray(theta0), (R, theta0.size))
    state = place(jax.vmap(outer.init)(harness.unflatten(anchor)))
    out = []
    for d in deltas:
        params, state = sync(place(harness.unflatten(anchor - d)), state)
        anchor = harness.flatten(params)
        out.append(np.asarray(anchor, np.float64))
    return np.stack(out), _residuals(state)


def _want(fmt, block, deltas, theta0, delay=0, segments=None):
    """The numpy loop in float32 (a rounding apart would land across a quantization
    threshold now and then, an int8 one in ~1e-5 elements)."""
    local = lambda t, anchor: [anchor - d for d in deltas[t]]
    R = deltas.shape[1]
    return ts.diloco_feedback_two_step(
        local, theta0, ROUNDS, R, ETA, MU, DECAY, SCALE, fmt, block, delay, segments, np.float32
    )


def _check(got, got_e, want, want_e, sends=ROUNDS):
    """The anchors of every round, and the residuals after ``sends`` sends."""
    anchors = np.broadcast_to(want[:, None], got.shape)
    np.testing.assert_allclose(got, anchors, **TOL)
    np.testing.assert_allclose(got_e, want_e[sends - 1], **RESIDUAL_TOL)
    assert np.abs(want_e[sends - 1]).max() > 1e-3  # the residual carries something


# every block codec; R = 3, 4, 8; 200 and 1000 elements against blocks of 128, odd sizes
# against small blocks: none is a multiple of R blocks
CASES = [
    ("int8", 4, 200, 128),
    ("int8", 3, 1001, 16),
    ("int4", 8, 200, 128),
    ("int4", 3, 205, 4),
    ("fp8", 3, 1000, 128),
    ("fp8", 8, 203, 16),
    ("fp4", 4, 1000, 128),
    ("fp4", 8, 1001, 4),
    ("2bit", 8, 1000, 128),
    ("2bit", 4, 203, 16),
    ("2bit", 3, 200, 128),
]


IDS = [f"{fmt}-R{R}-n{n}-b{block}" for fmt, R, n, block in CASES]


@pytest.mark.parametrize("fmt,R,n,block", CASES, ids=IDS)
@pytest.mark.cases("each")  # every codec, R, size and block by default; all with -m slow
def test_feedback_through_two_step_matches_textbook(fmt, R, n, block):
    outer = _outer(fmt, block)
    deltas, theta0 = _deltas(R, n, seed=n + R)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    got, got_e = _rounds(sync, outer, deltas, theta0)
    _check(got, got_e, *_want(fmt, block, deltas, theta0))
    # the shards are whole blocks, at the bytes of shards of ceil(n / R) elements
    codec, shapes = comm.make(fmt, block=block), jax.ShapeDtypeStruct((n,), jnp.float32)
    sent = 2 * (R - 1) * codec.wire_bytes(ts.two_step_shard(n, R, block))
    assert outer.reducer.wire_bytes(shapes, R) == sent == 2 * (R - 1) * codec.wire_bytes(-(-n // R))


def test_under_the_engines_replica_map():
    """On the 8-device mesh, mapped by hand over ``replica`` as the engines do (each replica's
    tensors whole, the ``data`` layout the compiler's)."""
    fmt, R, n, block = "2bit", 4, 200, 128
    mesh = harness.make_mesh(replica=R, data=2)
    outer = _outer(fmt, block)
    deltas, theta0 = _deltas(R, n, seed=1)
    sync = jax.jit(co2jax.mesh.replica_map(outer.sync, mesh))
    place = lambda tree: harness.place(tree, mesh, P("replica"))
    got, got_e = _rounds(sync, outer, deltas, theta0, place)
    _check(got, got_e, *_want(fmt, block, deltas, theta0))


def test_leaf_shards_of_a_manual_data_axis_are_encoded_on_their_own():
    """Inside a shard_map manual over ``replica`` and ``data``, ``w`` split over ``data``:
    error feedback and the collective both encode ``b`` (replica-varying) and each device's
    half of ``w`` as groups of their own, blocks from each group's start."""
    fmt, R, n, block = "int8", 4, 200, 16
    mesh = harness.make_mesh(replica=R, data=2, axis_type=AxisType.Auto)  # b, w joined outside
    outer = _outer(fmt, block)
    deltas, theta0 = _deltas(R, n, seed=2)
    half = (n - harness.SPLIT) // 2
    spec = lambda x: P("replica", "data") if x.shape[-1] == n - harness.SPLIT else P("replica")

    def run(params, state):
        one = lambda tree: jax.tree.map(lambda x: x[0], tree)
        params, state = outer.sync(one(params), one(state))
        return jax.tree.map(lambda x: x[None], (params, state))

    cache = {}

    def sync(params, state):
        specs = jax.tree.map(spec, (params, state))
        if "fn" not in cache:
            cache["fn"] = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=specs))
        return cache["fn"](params, state)

    place = lambda tree: jax.tree.map(lambda x: harness.place(x, mesh, spec(x)), tree)
    got, got_e = _rounds(sync, outer, deltas, theta0, place)
    want = _want(fmt, block, deltas, theta0, segments=[harness.SPLIT, half, half])
    _check(got, got_e, *want)


def test_spread_in_chunks_by_the_per_step_adapter():
    """Delayed DiLoCo's transfer cut into a chunk per inner step (``spread=True``): each
    chunk's whole blocks reduced on their own give the whole reduction's values."""
    fmt, R, n, block, H = "int8", 3, 203, 16, 4
    outer = _outer(fmt, block, delay=1)
    deltas, theta0 = _deltas(R, n, seed=3)
    tx = co2jax.local_updates(optax.sgd(1.0), outer, H, spread=True)
    params = harness.unflatten(jnp.broadcast_to(jnp.asarray(theta0), (R, n)))
    state = jax.vmap(tx.init)(params)
    step = jax.jit(jax.vmap(tx.update, axis_name="replica"))
    got = []
    for t in range(ROUNDS):
        for k in range(H):  # the round's pseudo-gradient as the first step's gradient
            grads = harness.unflatten(jnp.asarray(deltas[t] if k == 0 else 0 * deltas[t]))
            updates, state = step(grads, state, params)
            params = optax.apply_updates(params, updates)
        got.append(np.asarray(harness.flatten(params), np.float64))
    want = _want(fmt, block, deltas, theta0, delay=1)
    # round t's pseudo-gradient is sent at the start of round t + 1
    _check(np.stack(got), _residuals(state), *want, sends=ROUNDS - 1)


def test_muloco_defaults_on_200_parameters_follow_the_documented_rule():
    """MuLoCo as registered (2-bit in blocks of 128, two-step collective, error feedback 0.9
    carrying the outer learning rate 0.9, Nesterov 0.9 / 0.8) on the 200-parameter quadratic
    (vectors: SGD inside) for 4 rounds."""
    lr, H, R = 0.1, 4, 4
    problem = tb.make_problem(replicas=R, examples=2, dim=200, seed=4)
    outer, inner = harness.registered(
        "muloco", problem, lr, H, compression="2bit", collective="two_step"
    )
    assert outer.reducer.name == "all_reduce_compressed(2bit)"
    got, state = harness.run_rounds(outer, problem, lr, H, ROUNDS, inner=inner)
    local = lambda t, anchor: [tb.inner_sgd(problem, r, anchor, lr, H) for r in range(R)]
    want = ts.diloco_feedback_two_step(
        local, problem.theta0, ROUNDS, R, 0.9, 0.8, 0.9, 0.9, "2bit", 128
    )
    _check(got, _residuals(state), *want)


def test_a_reducer_that_does_not_say_what_it_transmits_is_refused():
    """A compressed reducer with neither a gather form nor a roundtrip: error feedback cannot
    know the block layout it encodes in, so it does not guess the whole vector's."""
    two_step = comm.all_reduce_compressed(comm.int8(block=16))
    silent = two_step._replace(name="silent", roundtrip=None)
    with pytest.raises(ValueError, match=r"outer.reducer='silent' transmits") as info:
        co2jax.error_feedback(co2jax.diloco(optax.sgd(1.0), reduce=silent))
    assert "\n" not in str(info.value)


def test_spread_by_the_round_engine_in_two_stages_over_the_replicas_chips(R=4):
    """Delayed DiLoCo's transfer spread over the round's steps by the round engine: each of
    K = H - 1 pieces scattered encoded at its step and its encoded mean gathered at the next
    (the reducer's stages), every piece split over the replica's 2 chips (whole blocks each:
    203 elements in blocks of 16, not a multiple of R blocks; R = 3 and 5 for the stages
    alone: tests/test_chunks.py), against the numpy loop; the
    residual carries something, and the round's bytes are the model's (K + 1) / K of the
    two-step's."""
    from test_engine import engine_loss, textbook_batch

    fmt, block, H, lr = "int8", 16, 4, 0.1
    problem = tb.make_problem(replicas=R, examples=2, dim=203, seed=R)
    mesh = harness.make_mesh(replica=R, data=2)
    outer = _outer(fmt, block, delay=1)
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(lr), outer, mesh, H, spread=H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    program = trainer.program(state)
    assert [t.chunks for t in program.transfers] == [H]  # K = H - 1 pieces over H steps
    text = trainer.lower(state, textbook_batch(problem, H)).compile().as_text()
    permutes = [c for c in co2jax.hlo.collectives(text) if c.op == "collective-permute"]
    assert len(permutes) == R - 1 and "all-to-all" not in text  # the scatter's sends
    got = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        got.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    local = lambda t, anchor: [tb.inner_sgd(problem, r, anchor, lr, H) for r in range(R)]
    want = ts.diloco_feedback_two_step(
        local, problem.theta0, ROUNDS, R, ETA, MU, DECAY, SCALE, fmt, block, 1, None, np.float32
    )
    # round t's pseudo-gradient is sent at the start of round t + 1
    _check(np.stack(got), _residuals(jax.device_get(state.outer_state)), *want, ROUNDS - 1)
    per_piece = math.ceil(13 / (H - 1))  # 203 elements: 13 blocks of 16
    blocks = 2 * math.ceil(per_piece / 2)  # a piece's blocks: whole ones on each of 2 chips
    piece = jax.ShapeDtypeStruct((blocks * block,), jnp.float32)
    assert program.plan.wire_bytes == pytest.approx(H * outer.reducer.wire_bytes(piece, R))
