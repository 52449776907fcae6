"""The exact means by name: what ``reducer=`` chooses among (:mod:`co2jax.comm.policy`).

Each is the element-wise replica mean; they differ in how they cross the replica axis and
so in how a compiler can schedule them (``docs/overlap.md``): ``pmean`` (an all-reduce),
``all_gather`` (then a local float32 sum), ``ring`` (``ppermute`` steps), ``scatter_gather``
(an all-to-all, then an all-gather), ``staged`` (permutes, then an all-gather, which a
round may run at consecutive steps: :mod:`co2jax.comm.staged`) and ``staged_permutes`` (the
same, its all-gather by permutes too: for replicas that share TPU slices).

Example:
  >>> import jax, jax.numpy as jnp
  >>> reduce = exact_mean("staged")
  >>> jax.jit(jax.vmap(reduce, axis_name="replica"))(jnp.array([[1.0], [3.0], [8.0]]))[0]
  Array([4.], dtype=float32)
"""

from __future__ import annotations

from co2jax._checks import check_choice
from co2jax.axes import REPLICA
from co2jax.comm.reducer import (
    Reducer,
    all_gather_mean,
    pmean,
    ring_mean,
    scatter_gather_mean,
)
from co2jax.comm.staged import staged_mean

KINDS = {
    "pmean": pmean,
    "all_gather": all_gather_mean,
    "ring": ring_mean,
    "scatter_gather": scatter_gather_mean,
    "staged": staged_mean,
    "staged_permutes": lambda axis_name: staged_mean(axis_name, gather="permutes"),
}
EXACT = tuple(KINDS)


def exact_mean(kind: str, axis_name: str = REPLICA) -> Reducer:
    """The exact mean named ``kind`` (one of ``EXACT``)."""
    check_choice("reducer", kind, EXACT)
    return KINDS[kind](axis_name)
