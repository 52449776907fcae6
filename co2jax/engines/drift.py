"""Drift detection: the replicas' copies of the replica-invariant outer state compared.

Every replica computes the outer step itself, from the same reduced payload. The copies of
the anchor must then stay bit-identical on every replica. Different initial parameters (a
seed that differs between jobs), a reduction summed in another order, or a bug in an outer
optimizer makes them drift apart silently. :func:`replica_fingerprints` digests each
replica's copy (:func:`co2jax.tree.fingerprint`: any one changed bit changes it), and
:func:`check_drift` reports a mismatch with the round and the replicas.

What is compared: the anchor the state declares (:func:`co2jax.protocol.anchor_of`, through
wrappers' states). Fields that legitimately differ between replicas (error-feedback
residuals) are not compared. Algorithms
whose anchors are replica-local (eager updates, NoLoCo, DCT-momentum DiLoCo) have nothing to
compare: :func:`invariant_part` raises for them.

Example:
  >>> import jax, jax.numpy as jnp, optax, co2jax
  >>> outer = co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True))
  >>> state = jax.vmap(outer.init)(jnp.zeros((3, 2)))      # 3 replicas' copies
  >>> check_drift(replica_fingerprints(state), round=0)    # all equal: nothing raised
  >>> state = state._replace(anchor=state.anchor.at[2, 0].set(1e-30))
  >>> try:
  ...     check_drift(replica_fingerprints(state), round=5)
  ... except DriftError as e:
  ...     print(e.replicas)
  (2,)
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from co2jax.protocol import anchor_of
from co2jax.tree import fingerprint


class DriftError(RuntimeError):
    """The replicas' replica-invariant outer state differs. ``round``: when it was found;
    ``replicas``: the ranks outside the largest group of equal copies; ``fingerprints``: by
    rank."""

    def __init__(self, message: str, round: int, replicas: tuple, fingerprints: dict):
        super().__init__(message)
        self.round, self.replicas, self.fingerprints = round, replicas, fingerprints


def invariant_part(outer_state: Any) -> list:
    """The leaves of the anchor ``outer_state`` declares (:func:`co2jax.protocol.anchor_of`)."""
    anchor = anchor_of(outer_state)
    if anchor is None:
        raise ValueError(
            f"the outer state ({type(outer_state).__name__}) declares no anchor to compare "
            "across replicas (co2jax.protocol.StateRoles)"
        )
    return jax.tree.leaves(anchor)


def replica_fingerprints(stacked_outer_state: Any) -> dict:
    """``{replica: uint32}`` for an outer state whose leaves have a leading replica axis (a
    :class:`~co2jax.TrainState`'s)."""
    leaves = invariant_part(stacked_outer_state)
    digests = np.asarray(jax.jit(jax.vmap(fingerprint))(leaves))
    return {r: int(d) for r, d in enumerate(digests)}


def check_drift(fingerprints: dict, round: int) -> None:
    """Raises :class:`DriftError` unless every replica's fingerprint is the same; the
    message names the round and the groups of replicas that agree."""
    groups = collections.defaultdict(list)
    for rank, digest in sorted(fingerprints.items()):
        groups[digest].append(rank)
    if len(groups) <= 1:
        return
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    outliers = tuple(sorted(r for _, ranks in ranked[1:] for r in ranks))
    listing = "; ".join(f"replicas {ranks} hold {digest:#010x}" for digest, ranks in ranked)
    raise DriftError(
        f"round {round}: the replica-invariant outer state differs between replicas "
        f"({listing}); replicas {list(outliers)} drifted from the largest group",
        round,
        outliers,
        dict(fingerprints),
    )
