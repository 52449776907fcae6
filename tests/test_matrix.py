"""Every algorithm of the registry in every driver and every layout, equal to its textbook loop.

Drivers: the round-level ``outer.sync`` under ``jax.vmap`` and mapped over the replica axis of
a mesh (``co2jax.mesh.replica_map``), the per-step adapter (``local_updates``) under both, the
round engine, the round engine with the fused Pallas update (interpreter) where the
algorithm is fusable, and the round engine with its overlapped transfers in a chunk per step,
each reduced in two stages at consecutive steps (``reducer="staged"``: a ring's bytes,
``co2jax.comm.staged``) where the algorithm reduces by an exact mean. Layouts
(the mesh drivers): the state whole in each replica ("replicated"), the outer state split
over ``data`` ("sharded"), parameters and inner state split over ``data`` too ("fsdp"), a
parameter split over ``model`` (tensor parallel, "tp"), and both ("fsdp_tp": one parameter
over ``data``, the other over ``model``). Every cell
matches ``textbook.REGISTERED`` at rtol 1e-5 (float32): a layout changes no value, and no
algorithm is another one on a split tensor. Separate jobs (``JobTrainer``) are checked
against the round engine in ``test_multijob.py``. A cell that cannot be run says why in
``NOT_APPLICABLE``, and that list is checked too.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from jax.sharding import PartitionSpec as P
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax.algorithms import registry
from co2jax.engines.layout import Layout, full_spec

LR, H, ROUNDS = 0.1, tb.REGISTERED_H, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]

# (replica, data, model), the engine's layout options, and where each parameter lies
LAYOUTS = {
    "replicated": ((4, 2, 1), {}, None),
    "sharded": ((4, 2, 1), {"shard_outer_state": True}, None),
    "fsdp": ((4, 2, 1), {"fsdp": True}, None),
    "tp": ((4, 1, 2), {}, {"b": P("model"), "w": P("model")}),
    "fsdp_tp": ((2, 2, 2), {"fsdp": True}, {"b": None, "w": P("model")}),
    # the outer state split over data and kept in host memory: the round engine's option
    "sharded_offload": ((4, 2, 1), {"shard_outer_state": True, "offload_outer_state": True}, None),
}
ENGINE_ONLY = {"sharded_offload": ("engine",)}  # a layout only the round engine offers
ON_ONE_DEVICE = ("vmap_sync", "adapter")
ON_A_MESH = ("shard_map_sync", "adapter_shard_map", "engine", "engine_fused", "engine_staged")
DRIVERS = ON_ONE_DEVICE + ON_A_MESH
NOT_APPLICABLE = {
    ("streaming_diloco", "vmap_sync"): "applies fragments during the round: no round-level sync",
    ("streaming_diloco", "shard_map_sync"): "applies fragments during the round",
    ("cocodc", "vmap_sync"): "applies fragments during the round: no round-level sync",
    ("cocodc", "shard_map_sync"): "applies fragments during the round",
    **{
        (name, "engine_fused"): "not fusable"
        for name in registry.NAMES
        if not registry.capabilities(name).fusable
    },
}
NOT_APPLICABLE.update(
    {(v, d): why for v, (base, _, _) in tb.VARIANTS.items() for (n, d), why in
     list(NOT_APPLICABLE.items()) if n == base}
)  # fmt: skip
NAMES = (*registry.NAMES, *tb.VARIANTS)


def _reduces_exactly(name: str) -> bool:
    problem = tb.make_problem(replicas=2, examples=2, dim=16, seed=5)
    return harness.registered(name, problem, LR, H)[0].reducer.exact


NOT_APPLICABLE.update(
    {
        (name, "engine_staged"): "its own reduction is not an exact mean: nothing to stage"
        for name in NAMES
        if not _reduces_exactly(name)
    }
)
CELLS = [
    (n, d, layout)
    for n in NAMES
    for d in DRIVERS
    if (n, d) not in NOT_APPLICABLE
    for layout in (("replicated",) if d in ON_ONE_DEVICE else LAYOUTS)
    if d in ENGINE_ONLY.get(layout, DRIVERS)
]


SPLIT = [lay for lay in LAYOUTS if lay != "replicated" and lay not in ENGINE_ONLY]


def mesh_drivers(name: str) -> list[str]:
    return [d for d in ON_A_MESH if (name, d) not in NOT_APPLICABLE]


def runs_by_default(name: str, driver: str, layout: str) -> bool:
    """The matrix's share of the default suite (``tests/budget.py``), from the registry and
    the capabilities: every algorithm in every driver and at every layout. The one-device
    drivers run at the whole layout ("replicated"), their only one; the mesh drivers at the
    split layouts, one driver per layout taken in turn by the algorithm's position among
    those with the same drivers and the layout's (across algorithms every driver meets every
    layout), and at the whole layout
    any mesh driver the turns leave out for this algorithm (five mesh drivers, four split
    layouts); every mesh driver at the whole layout, and the round engine's host-memory
    option, for one algorithm in four. The other cells run with -m slow."""
    position = NAMES.index(name)
    drivers = mesh_drivers(name)
    turn = [n for n in NAMES if mesh_drivers(n) == drivers].index(name)  # among its likes
    turns = [drivers[(turn + j) % len(drivers)] for j in range(len(SPLIT))]
    if layout == "replicated":  # and a mesh driver the split layouts' turns leave out
        return driver in ON_ONE_DEVICE or position % 4 == 2 or driver not in turns
    if layout in ENGINE_ONLY:
        return position % 4 == 0
    return driver == turns[SPLIT.index(layout)]


def problem_for(layout: str) -> tb.Problem:
    return tb.make_problem(replicas=LAYOUTS[layout][0][0], examples=2, dim=16, seed=5)


def mesh_for(layout: str):
    replica, data, model = LAYOUTS[layout][0]
    return co2jax.make_mesh(replica, data, model, devices=jax.devices("cpu")[:8])


def place(tree, mesh, specs):
    """Per-replica specs with the leading replica axis, as the engine lays its state (on the
    mesh ``replica_map``'s results lie on: its data and model axes Auto)."""
    mesh = co2jax.mesh.compiler_sharded(mesh)
    return jax.tree.map(
        lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, full_spec(s, x.ndim - 1))),
        tree,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def layout_specs(layout: str, outer, inner, params):
    """Per-replica specs of (params, inner state, outer state) in ``layout``."""
    (replica, data, model), options, specs = LAYOUTS[layout]
    options = {k: v for k, v in options.items() if k != "offload_outer_state"}
    lay = Layout({"data": data, "model": model}, **options)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    param = lay.param_specs(shapes, specs)
    return (
        param,
        lay.inner_specs(inner.init, shapes, param, replica),
        lay.outer_specs(outer.init, shapes, specs, replica),
    )


def _sync(outer, inner, problem, mesh, layout):
    """``outer.sync`` after H inner steps, in a program mapped over the replica axis."""
    params = harness.initial_params(problem)
    state, inner_state = jax.vmap(outer.init)(params), jax.vmap(inner.init)(params)
    specs = layout_specs(layout, outer, inner, params)
    params, inner_state, state = (
        place(t, mesh, s) for t, s in zip((params, inner_state, state), specs, strict=True)
    )
    rep = P("replica")
    d = harness.place(jnp.asarray(problem.d), mesh, rep)
    c = harness.place(jnp.asarray(problem.c), mesh, P("replica", "data"))
    round_fn = harness.shard_round(outer, inner, mesh, H)
    out = []
    for _ in range(ROUNDS):
        params, inner_state, state = round_fn(params, inner_state, state, d, c)
        out.append(np.asarray(harness.flatten(params), np.float64))
    return np.stack(out)


def _adapter(outer, inner, problem, mesh, layout):
    tx = co2jax.local_updates(inner, outer, H)
    params, state, d, c = harness.shard_step_args(tx, problem, mesh)
    (param_specs, inner_specs, outer_specs) = layout_specs(
        layout, outer, inner, harness.initial_params(problem)
    )
    params = place(params, mesh, param_specs)
    state = state._replace(
        inner_state=place(state.inner_state, mesh, inner_specs),
        outer_state=place(state.outer_state, mesh, outer_specs),
    )
    step = harness.shard_step(tx, mesh)
    out = []
    for i in range(ROUNDS * H):
        params, state = step(params, state, d, c)
        if (i + 1) % H == 0:
            out.append(np.asarray(harness.flatten(params), np.float64))
    return np.stack(out)


def _engine(outer, inner, problem, mesh, layout, **kw):
    _, options, specs = LAYOUTS[layout]
    trainer = co2jax.RoundTrainer(
        engine_loss, inner, outer, mesh, H, param_specs=specs, **options, **kw
    )
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out), trainer, state


def run(name, driver, layout, problem):
    if driver == "vmap_sync":
        outer, inner = harness.registered(name, problem, LR, H)
        return harness.run_vmap(outer, problem, LR, H, ROUNDS, inner=inner)[0]
    if driver == "adapter":
        outer, inner = harness.registered(name, problem, LR, H)
        return harness.run_adapter(outer, inner, problem, H, ROUNDS)
    mesh = mesh_for(layout)
    if driver == "engine_fused":
        outer, inner = harness.registered(name, problem, LR, H, implementation="interpret")
        # Pallas' interpreter is not typed for shard_map's varying-axis check; the "engine"
        # cells are the twins with the check on (the fused update's jnp path)
        got, trainer, state = _engine(
            outer, inner, problem, mesh, layout, reducer="all_gather", check_vma=False
        )
        assert trainer.program(state).reducer_kind == "all_gather"
        return got
    outer, inner = harness.registered(name, problem, LR, H)
    if driver == "engine_staged":  # every overlapped transfer in a chunk per step it spans
        got, trainer, state = _engine(
            outer, inner, problem, mesh, layout, reducer="staged", spread=H
        )
        assert set(trainer.program(state).plan.kinds) <= {"staged"}  # DDP: no transfer
        return got
    if driver == "shard_map_sync":
        return _sync(outer, inner, problem, mesh, layout)
    if driver == "adapter_shard_map":
        return _adapter(outer, inner, problem, mesh, layout)
    return _engine(outer, inner, problem, mesh, layout)[0]


@pytest.mark.parametrize(
    "name, driver, layout", CELLS, ids=[f"{n}-{d}-{lay}" for n, d, lay in CELLS]
)
@pytest.mark.cases(rule=runs_by_default)
def test_matches_textbook(name, driver, layout):
    problem = problem_for(layout)
    want = tb.loop_of(name)(problem, LR, H, ROUNDS)
    got = run(name, driver, layout, problem)
    np.testing.assert_allclose(got, want, **TOL)


def test_the_textbook_loops_move():
    """No cell passes by standing still: every loop leaves theta0 by the third round."""
    for layout in ("replicated", "fsdp_tp"):
        problem = problem_for(layout)
        for name in NAMES:
            moved = np.abs(tb.loop_of(name)(problem, LR, H, ROUNDS)[-1] - problem.theta0)
            assert moved.max() > 1e-2, (name, layout)


def test_not_applicable_cells_are_the_documented_ones():
    """Every algorithm runs in every driver and every layout but the cells listed, each for
    its reason; none is refused for a split tensor."""
    assert {d for _, d in NOT_APPLICABLE} <= set(DRIVERS)
    assert not any("shard" in why or "split" in why for why in NOT_APPLICABLE.values())
    for name in registry.NAMES:
        ran = {(d, lay) for n, d, lay in CELLS if n == name}
        for driver in ("adapter_shard_map", "engine"):
            offered = {lay for lay in LAYOUTS if driver in ENGINE_ONLY.get(lay, DRIVERS)}
            assert {(driver, lay) for lay in offered} <= ran, name
        assert {("engine", lay) for lay in ENGINE_ONLY} <= ran, name


def test_the_layouts_split_what_they_say():
    """Each layout really splits the state it names (the engine's placed state)."""
    problem = problem_for("fsdp_tp")
    outer, inner = harness.registered("diloco", problem, LR, H)
    *_, state = _engine(outer, inner, problem, mesh_for("fsdp_tp"), "fsdp_tp")
    shard = lambda x: x.sharding.shard_shape(x.shape)
    assert shard(state.params["b"]) == (1, 1)  # FSDP: b (2) over data
    assert shard(state.params["w"]) == (1, 7)  # TP: w (14) over model
    anchor = state.outer_state.inner_state.anchor  # the outer state where its parameters lie
    assert shard(anchor["b"]) == (1, 1) and shard(anchor["w"]) == (1, 7)


# ---------------------------------------------------------------------------------------------
# an algorithm added by a user, with whole-tensor math and no knowledge of sharding


def clipped_averaging(learning_rate: float, max_norm: float) -> co2jax.OuterOptimizer:
    """Each replica clips its pseudo-gradient to ``max_norm`` by its global norm (over every
    leaf), the replicas average them, the anchor steps by ``learning_rate``: written as a
    user would, with no sharding in it."""

    def init(params):
        return {"anchor": params}

    def send(params, state, i):
        delta = jax.tree.map(lambda a, p: a - p, state["anchor"], params)
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(delta)))
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
        return jax.tree.map(lambda x: x * scale, delta), state

    def apply(params, state, i, reduced):
        anchor = jax.tree.map(lambda a, g: a - learning_rate * g, state["anchor"], reduced)
        return anchor, {"anchor": anchor}

    return co2jax.OuterOptimizer(init, send, co2jax.comm.pmean(), apply)


def clipped_averaging_textbook(problem: tb.Problem, lr, H, rounds, eta, max_norm):
    anchor, out = problem.theta0.copy(), []
    for _ in range(rounds):
        sent = []
        for r in range(problem.replicas):
            delta = anchor - tb.inner_sgd(problem, r, anchor, lr, H)
            sent.append(delta * min(1.0, max_norm / np.linalg.norm(delta)))
        anchor = anchor - eta * np.mean(sent, axis=0)
        out.append(np.broadcast_to(anchor, (problem.replicas, anchor.size)).copy())
    return np.stack(out)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("driver", ["shard_map_sync", "adapter_shard_map", "engine"])
@pytest.mark.cases("each")  # every driver and every layout by default; all pairs with -m slow
def test_a_whole_tensor_algorithm_at_every_layout(driver, layout):
    """A global-norm clip needs every element of every leaf: with the state split over data
    or model it still sees whole tensors, so it equals its loop at every layout (the clip
    binds: the norms before clipping are above max_norm)."""
    problem = problem_for(layout)
    want = clipped_averaging_textbook(problem, LR, H, ROUNDS, 0.8, 0.05)
    first = problem.theta0 - tb.inner_sgd(problem, 0, problem.theta0, LR, H)
    assert np.linalg.norm(first) > 0.05  # the clip is active
    outer, inner = clipped_averaging(0.8, 0.05), optax.sgd(LR)
    mesh = mesh_for(layout)
    if driver == "shard_map_sync":
        got = _sync(outer, inner, problem, mesh, layout)
    elif driver == "adapter_shard_map":
        got = _adapter(outer, inner, problem, mesh, layout)
    else:
        got = _engine(outer, inner, problem, mesh, layout)[0]
    np.testing.assert_allclose(got, want, **TOL)
