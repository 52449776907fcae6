"""Communication is asserted, not assumed: collectives counted in the compiled HLO."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import optax
import pytest
import textbook as tb
from jax.sharding import PartitionSpec as P
from test_algorithms import CASES, IDS

import co2jax
from co2jax import hlo as co2jax_hlo

H = 3
DIM = 5  # parameters per replica in the textbook problem


def _round_args(outer, problem, mesh, inner):
    params = harness.initial_params(problem)
    rep = P("replica")
    return [
        harness.place(x, mesh, rep)
        for x in (params, jax.vmap(inner.init)(params), jax.vmap(outer.init)(params))
    ] + [
        harness.place(jnp.asarray(problem.d), mesh, rep),
        harness.place(jnp.asarray(problem.c), mesh, P("replica", "data")),
    ]


@pytest.fixture(scope="module")
def mesh():
    return harness.make_mesh(replica=4, data=2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 9)
def test_one_sync_reduces_one_payload_over_the_replica_axis(case, mesh):
    problem = tb.make_problem()
    inner, outer = optax.sgd(0.1), case.make()
    fn = harness.shard_round(outer, inner, mesh, H)
    hlo = fn.lower(*_round_args(outer, problem, mesh, inner)).compile().as_text()
    n = harness.count_replica_collectives(hlo, mesh)
    assert 1 <= n <= 2  # one pmean per leaf; XLA may combine them into one instruction
    assert harness.replica_reduced_elements(hlo, mesh) == DIM  # exactly one payload
    assert harness.count_replica_collectives(hlo, mesh, op="all-gather") == 0


def test_inner_steps_have_no_replica_collective(mesh):
    """The inner loop alone: gradients averaged over "data", nothing over "replica"."""
    problem = tb.make_problem()
    inner = optax.adam(0.1)
    identity = co2jax.no_sync()
    fn = harness.shard_round(identity, inner, mesh, H)
    hlo = fn.lower(*_round_args(identity, problem, mesh, inner)).compile().as_text()
    assert harness.count_replica_collectives(hlo, mesh) == 0
    data = co2jax_hlo.over_axis(co2jax_hlo.collectives(hlo), mesh, "data")
    assert data, "the data-axis gradient mean must be visible to the parser"


def test_data_parallel_reduces_every_gradient(mesh):
    problem = tb.make_problem()
    opt = co2jax.data_parallel(optax.sgd(0.1))
    args = harness.shard_step_args(opt, problem, mesh)
    fn = harness.shard_step(opt, mesh)
    hlo = fn.lower(*args).compile().as_text()
    assert harness.replica_reduced_elements(hlo, mesh) == DIM
