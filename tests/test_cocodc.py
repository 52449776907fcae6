"""CoCoDC (reconstructed): the textbook loop in every driver, identities, an analytic case."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_cocodc as tbc
from test_engine import engine_loss, textbook_batch
from test_streaming import run_steps

import co2jax
from co2jax.fragments import make_fragments

LR, H, ROUNDS = 0.1, 8, 3
ETA, MU = 0.7, 0.9
TOL = harness.TOL[jnp.dtype(jnp.float32)]
# the textbook params {"b": theta[:2], "w": theta[2:]}, "w" split per element: P = 2 strided
# puts b, w[0], w[2] in fragment 0 and w[1] in fragment 1 (flat indices of theta)
FLAT = [[0, 1, 2, 4], [3]]


def _outer(correction, tau, alpha, hessian_scale=0.5, reduce=None):
    frags = make_fragments(harness.unflatten(jnp.zeros(5)), 2, stacked="w")
    nesterov = optax.sgd(ETA, momentum=MU, nesterov=True)
    return co2jax.cocodc(nesterov, frags, H, tau, alpha, correction, hessian_scale, reduce=reduce)


def _streaming(tau, alpha):
    frags = make_fragments(harness.unflatten(jnp.zeros(5)), 2, stacked="w")
    nesterov = optax.sgd(ETA, momentum=MU, nesterov=True)
    return co2jax.streaming_diloco(nesterov, frags, H, tau, alpha)


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2)


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


def _adapter(outer, problem, mesh=None):
    """The per-step adapter (plain SGD inside), under vmap or on the (replica, data) mesh."""
    return harness.run_adapter(outer, optax.sgd(LR), problem, H, ROUNDS, mesh)


def _engine(outer, problem, mesh, **kw):
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H, **kw)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out)


def _textbook(problem, correction, tau, alpha):
    return tbc.cocodc_nesterov(problem, LR, H, ROUNDS, FLAT, tau, alpha, ETA, MU, correction)


def test_textbook_without_correction_is_the_streaming_textbook(problem):
    for tau, alpha in [(0, 0.0), (1, 0.5), (3, 1.0)]:
        got, largest = _textbook(problem, "none", tau, alpha)
        want = tb.streaming_nesterov(problem, LR, H, ROUNDS, FLAT, tau, alpha, ETA, MU)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert largest == 0.0


CASES = [("zeroth", 1, 0.0), ("zeroth", 2, 0.5), ("first", 1, 0.5), ("first", 3, 0.0)]
DRIVERS = ["adapter", "adapter_shard_map", "engine"]
CASES_BY_DRIVER = [(*case, d) for case in CASES for d in DRIVERS]
# every case in the round engine and the first in every driver by default; the adapter cells
# of the other cases with -m slow (the suite's 15-minute budget; the registry matrix runs
# cocodc in every driver too)
CELLS = [
    (*case, d)
    if d == "engine" or case == CASES[0]
    else pytest.param(*case, d, marks=pytest.mark.slow)
    for case in CASES
    for d in DRIVERS
]


@pytest.mark.parametrize(
    "correction, tau, alpha, driver",
    CELLS,
    ids=[f"{c}-tau{t}-alpha{a}-{d}" for c, t, a, d in CASES_BY_DRIVER],
)
@pytest.mark.cases("first", 3)
def test_matches_textbook(correction, tau, alpha, driver, problem, mesh):
    want, largest = _textbook(problem, correction, tau, alpha)
    # the correction is at work: |c - global| reaches well above the tolerance, and the
    # trajectory leaves Streaming DiLoCo's
    assert largest > 1e-2
    streaming, _ = _textbook(problem, "none", tau, alpha)
    assert np.abs(want - streaming).max() > 1e-3
    if correction == "first":  # and the Taylor term moves it off the zeroth-order one
        zeroth, _ = _textbook(problem, "zeroth", tau, alpha)
        assert np.abs(want - zeroth).max() > 1e-4
    outer = _outer(correction, tau, alpha)
    if driver == "engine":
        got = _engine(outer, problem, mesh)
    else:
        got = _adapter(outer, problem, mesh if driver == "adapter_shard_map" else None)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("layout", ["shard_outer_state", "fsdp"])
def test_sharded_outer_state_matches_textbook(layout, problem, mesh):
    """The recorded send values split over data with the parameters ("b" is split, the
    stacked "w" stays whole): the correction is element-wise, computed shard by shard."""
    want, _ = _textbook(problem, "first", 2, 0.5)
    got = _engine(_outer("first", 2, 0.5), problem, mesh, **{layout: True})
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_no_correction_is_streaming_diloco(problem, mesh):
    got = _adapter(_outer("none", 2, 0.5), problem)
    want = _adapter(_streaming(2, 0.5), problem)
    np.testing.assert_array_equal(got, want)
    got = _engine(_outer("none", 2, 0.5), problem, mesh)
    want = _engine(_streaming(2, 0.5), problem, mesh)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_no_overlap_leaves_nothing_to_correct(problem):
    """tau = 0: sent and applied at the same step, the drift is zero."""
    got = _adapter(_outer("first", 0, 0.5), problem)
    want = _adapter(_streaming(0, 0.5), problem)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_two_replicas_by_hand():
    """One fragment w, H = 2, tau = 1, inner SGD lr 1 with a fixed gradient (1 on replica 0,
    3 on replica 1), outer plain SGD lr 1, everything from w = 0.

    Round 1. After step 1 w = (-1, -3): sent y = (-1, -3), Delta = 0 - y = (1, 3), mean 2.
    After step 2 w = (-2, -6); the global copy moves to 0 - 1 * 2 = -2; drift d = w - y =
    (-1, -3).
      none, alpha 0:    w = -2                          -> (-2, -2)
      zeroth, alpha 0:  w = -2 + d                      -> (-3, -5)
      zeroth, alpha .5: w = .5 * (-2, -6) + .5 * (-3, -5) -> (-2.5, -5.5)
      first, alpha 0:   w = -2 + d + .5 * 2**2 * d = -2 + 3d -> (-5, -11)
    Round 2, zeroth, alpha 0. Step 1: w = (-4, -8) = y, Delta = -2 - y = (2, 6), mean 4.
    Step 2: w = (-5, -11); global -2 - 4 = -6; d = (-1, -3): w = (-7, -9). The global copy
    moved 4 = H steps of the mean gradient 2; Streaming DiLoCo (none) moves it by 2 in
    round 2 too (Delta = (1, 3): the tau steps before each apply are lost), to -4.
    """
    frags = make_fragments({"w": jnp.zeros(1)}, 1)
    fixed = lambda p, r: {"w": jnp.where(r == 0, 1.0, 3.0) * jnp.ones_like(p["w"])}

    def run(correction, alpha, rounds):
        outer = co2jax.cocodc(optax.sgd(1.0), frags, 2, 1, alpha, correction, 0.5)
        params = {"w": jnp.zeros((2, 1))}
        ends, (_, state) = run_steps(outer, params, fixed, 1.0, 2 * rounds)
        return [e["w"][:, 0].tolist() for e in ends], state.outer_state

    assert run("none", 0.0, 2)[0] == [[-2.0, -2.0], [-4.0, -4.0]]
    assert run("zeroth", 0.5, 1)[0] == [[-2.5, -5.5]]
    assert run("first", 0.0, 1)[0] == [[-5.0, -11.0]]
    ends, state = run("zeroth", 0.0, 2)
    assert ends == [[-3.0, -5.0], [-7.0, -9.0]]
    np.testing.assert_array_equal(co2jax.protocol.anchor_of(state)["w"], [[-6.0], [-6.0]])
    np.testing.assert_array_equal(state.sent[0][0], [[-4.0], [-8.0]])  # y of round 2's send


def test_state_fields_and_abstract_init():
    outer = _outer("zeroth", 1, 0.5)
    sds = lambda n: jax.ShapeDtypeStruct((n,), jnp.bfloat16)
    shapes = {"b": sds(2), "w": sds(3)}
    state = jax.eval_shape(outer.init, shapes)
    assert isinstance(state, co2jax.CoCoDCState)
    assert [[x.shape for x in frag] for frag in state.sent] == [[(2,), (2,)], [(1,)]]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.sent))
    assert co2jax.protocol.anchor_of(state) is state.streaming.anchor  # its declared role
    assert jax.eval_shape(_outer("none", 1, 0.5).init, shapes).sent == ()


def test_one_collective_per_fragment_as_streaming_diloco(problem, mesh):
    """The correction is local: the compiled round reduces exactly Streaming DiLoCo's
    payloads over the replica axis, one per fragment, sized to it."""

    def collectives(outer):
        trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, H)
        state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
        text = trainer.lower(state, trainer.place_batch(textbook_batch(problem, H)))
        found = co2jax.hlo.over_axis(
            co2jax.hlo.collectives(text.compile().as_text()), mesh, "replica"
        )
        return sorted((c.op, c.elements) for c in found)

    got = collectives(_outer("first", 1, 0.5))
    assert got == collectives(_streaming(1, 0.5))
    assert sorted(n for _, n in got) == sorted(len(idx) for idx in FLAT)


def test_composes_with_error_feedback(problem):
    """error_feedback wraps it like any outer optimizer: with a lossless codec, nothing
    changes."""
    lossless = co2jax.comm.all_gather_compressed(co2jax.comm.none())
    got = _adapter(co2jax.error_feedback(_outer("first", 1, 0.5, reduce=lossless)), problem)
    want = _adapter(_outer("first", 1, 0.5), problem)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bad_arguments():
    frags = make_fragments(harness.unflatten(jnp.zeros(5)), 2, stacked="w")
    sgd = optax.sgd(1.0)
    with pytest.raises(ValueError, match="correction must be one of"):
        co2jax.cocodc(sgd, frags, H, correction="second")
    for bad in (-0.1, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="hessian_scale"):
            co2jax.cocodc(sgd, frags, H, correction="first", hessian_scale=bad)
    with pytest.raises(ValueError, match="tau must be < H / P"):
        co2jax.cocodc(sgd, frags, H, tau=4)
    with pytest.raises(ValueError, match="alpha"):
        co2jax.cocodc(sgd, frags, H, alpha=1.5)
    with pytest.raises(ValueError, match="fragments must be"):
        co2jax.cocodc(sgd, [[0]], H)
