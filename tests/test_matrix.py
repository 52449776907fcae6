"""Every algorithm of the registry in every driver, equal to its numpy textbook loop.

Drivers: the round-level ``outer.sync`` under ``jax.vmap`` and under ``shard_map``, the
per-step adapter (``local_updates``) under both, and the round engine with whole, sharded
(``shard_outer_state``) and FSDP state, and with the fused Pallas update (interpreter) where
the algorithm is fusable. Each cell matches ``textbook.REGISTERED`` at rtol 1e-5 (float32).
Separate jobs (``JobTrainer``) are checked against the round engine in ``test_multijob.py``.
A cell that cannot be run says why in ``NOT_APPLICABLE``, and that list is checked too.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax.algorithms import registry

LR, H, ROUNDS = 0.1, tb.REGISTERED_H, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]
DRIVERS = (
    "vmap_sync",
    "shard_map_sync",
    "adapter",
    "adapter_shard_map",
    "engine",
    "engine_sharded",
    "engine_fsdp",
    "engine_fused",
)
NOT_APPLICABLE = {
    ("streaming_diloco", "vmap_sync"): "applies fragments during the round: no round-level sync",
    ("streaming_diloco", "shard_map_sync"): "applies fragments during the round",
    ("cocodc", "vmap_sync"): "applies fragments during the round: no round-level sync",
    ("cocodc", "shard_map_sync"): "applies fragments during the round",
    ("diloco_x", "engine_sharded"): "factors of a data shard are another algorithm",
    ("diloco_x", "engine_fsdp"): "factors of a data shard are another algorithm",
    ("dct_diloco", "engine_sharded"): "the DCT of a data shard's chunks is another transform",
    ("dct_diloco", "engine_fsdp"): "the DCT of a data shard's chunks is another transform",
    ("demo", "engine_fsdp"): "the DCT of a data shard's chunks is another transform",
    ("sparseloco", "engine_sharded"): "top-k of a data shard's chunks is another algorithm",
    ("sparseloco", "engine_fsdp"): "top-k of a data shard's chunks is another algorithm",
    **{
        (name, "engine_fused"): "not fusable"
        for name, entry in registry.REGISTRY.items()
        if not entry.capabilities.fusable
    },
}
NOT_APPLICABLE.update(
    {(v, d): why for v, (base, _, _) in tb.VARIANTS.items() for (n, d), why in
     list(NOT_APPLICABLE.items()) if n == base}
)  # fmt: skip
NAMES = (*registry.NAMES, *tb.VARIANTS)
CELLS = [(n, d) for n in NAMES for d in DRIVERS if (n, d) not in NOT_APPLICABLE]


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, dim=16, seed=5)


@pytest.fixture(scope="module")
def mesh():
    return co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])


def _adapter(outer, inner, problem, mesh=None):
    return harness.run_adapter(outer, inner, problem, H, ROUNDS, mesh)


def _engine(outer, inner, problem, mesh, **kw):
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, **kw)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out), trainer


def run(name, driver, problem, mesh):
    if driver == "engine_fused":
        outer, inner = harness.registered(name, problem, LR, H, implementation="interpret")
        # Pallas' interpreter is not typed for shard_map's varying-axis check; the "engine"
        # cells are the twins with the check on (the fused update's jnp path)
        got, trainer = _engine(outer, inner, problem, mesh, reducer="all_gather", check_vma=False)
        assert trainer.reducer_kind == "all_gather"
        return got
    outer, inner = harness.registered(name, problem, LR, H)
    if driver == "vmap_sync":
        return harness.run_vmap(outer, problem, LR, H, ROUNDS, inner=inner)[0]
    if driver == "shard_map_sync":
        return harness.run_shard_map(outer, problem, LR, H, ROUNDS, mesh, inner=inner)[0]
    if driver == "adapter":
        return _adapter(outer, inner, problem)
    if driver == "adapter_shard_map":
        return _adapter(outer, inner, problem, mesh)
    layout = {"engine_sharded": {"shard_outer_state": True}, "engine_fsdp": {"fsdp": True}}
    return _engine(outer, inner, problem, mesh, **layout.get(driver, {}))[0]


@pytest.mark.parametrize("name, driver", CELLS, ids=[f"{n}-{d}" for n, d in CELLS])
def test_matches_textbook(name, driver, problem, mesh):
    want = tb.loop_of(name)(problem, LR, H, ROUNDS)
    got = run(name, driver, problem, mesh)
    np.testing.assert_allclose(got, want, **TOL)


def test_the_textbook_loops_move():
    """No cell passes by standing still: every loop leaves theta0 by the third round."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=5)
    for name in NAMES:
        assert np.abs(tb.loop_of(name)(problem, LR, H, ROUNDS)[-1] - problem.theta0).max() > 1e-2, (
            name
        )


def test_not_applicable_cells_are_the_documented_ones():
    """Every algorithm runs in every driver but the cells listed, each for its reason; the
    only fusable-only driver is the fused one."""
    assert {d for _, d in NOT_APPLICABLE} <= set(DRIVERS)
    for name in registry.NAMES:
        ran = {d for n, d in CELLS if n == name}
        assert {"adapter", "adapter_shard_map", "engine"} <= ran, name
