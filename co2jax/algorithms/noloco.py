"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): outer steps with no global all-reduce."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_int, check_positive, check_unit_interval
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Settings, StepSize, fail, setting
from co2jax.axes import REPLICA
from co2jax.comm.gossip import gossip_mean, gossip_payload
from co2jax.protocol import SYNCHRONOUS, OuterOptimizer, Params, StateRoles, checked_roles
from co2jax.tree import tree_sub


def _split(reduced):
    return reduced["drift"], reduced["anchor"]


@checked_roles
class NoLoCoState(NamedTuple):
    """State of :func:`noloco` (one per replica).

    Attributes:
      anchor: this replica's anchor phi_r, where its current round started. Replica-varying
        (replica-local: no replica holds a global copy). Same dtype as the parameters.
      momentum: this replica's outer momentum delta_r, in the parameters' dtypes.
        Replica-varying.
      count: 0-d int32, outer steps taken. Replica-invariant (it selects the round's groups).
    """

    anchor: Params
    momentum: Params
    count: jax.Array

    ROLES = StateRoles("anchor", advances=("count",))


def noloco(
    learning_rate: float = 0.7,
    momentum: float = 0.5,
    group_size: int = 2,
    *,
    sync_every: int,
    cycle: int = 32,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """NoLoCo: each outer step averages with a random group of ``n`` replicas, not all R.

    Every replica r keeps its own anchor ``phi_r`` and momentum ``delta_r``. After H inner
    steps (parameters ``theta_r``) the replicas are dealt into groups of n by a permutation
    each of them derives from the inner step count (:func:`co2jax.comm.gossip_groups`); with
    G the group of r:

    .. math::

        \\bar g &= \\operatorname{mean}_{j \\in G} (\\theta_j - \\phi_j), \\qquad
        \\bar\\phi = \\operatorname{mean}_{j \\in G} \\phi_j \\\\
        \\delta_r &\\leftarrow \\mu\\,\\delta_r + \\eta\\,\\bar g
                                + \\eta\\,(\\bar\\phi - \\phi_r) \\\\
        \\phi_r &\\leftarrow \\phi_r + \\delta_r, \\qquad \\theta_r \\leftarrow \\phi_r

    A heavy-ball step with one learning rate on the descent term (the group's negated
    pseudo-gradient) and the consensus term (the pull toward the group's mean anchor). Each
    replica sends two model copies (``theta - phi`` and ``phi``) to each of its ``n - 1``
    group mates by ``ppermute``: the bytes per sync do not grow with R, and no collective
    spans all replicas. With ``n = R`` the anchors stay equal and the rule is DiLoCo with
    heavy-ball outer SGD (``optax.sgd(eta, momentum=mu)``).

    As in the released code the permutation of the sync after inner step s is
    ``numpy.random.default_rng(s + 1).permutation(R)`` and groups are dealt round-robin. The
    matchings of rounds ``0 .. cycle - 1`` are precomputed (a ``ppermute`` is static) and
    the sequence repeats after ``cycle`` rounds. Defaults of the released code: eta 0.7,
    mu 0.5, n 2, H 50 (the inner optimizer, Adam there, belongs to the training loop).

    Args:
      learning_rate: eta (> 0), on both terms.
      momentum: mu, in [0, 1).
      group_size: n, replicas per group (R must be a multiple of it).
      sync_every: H, the inner steps per round (the groups are drawn from the step count).
      cycle: rounds of precomputed matchings before the sequence repeats.
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.noloco(1.0, 0.0, group_size=2, sync_every=1)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> params  # two replicas form one group: both take the group's mean step
      Array([[2.],
             [2.]], dtype=float32)

    References:
      Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
      Models", arXiv 2506.10911.
    """
    eta = check_positive("learning_rate", learning_rate)
    mu = check_unit_interval("momentum", momentum)
    group_size = check_int("group_size", group_size, 1)
    sync_every = check_int("sync_every", sync_every, 1)
    check_axis_name("axis_name", axis_name)
    reducer = gossip_mean(group_size, sync_every, cycle, axis_name)

    def init(params: Params) -> NoLoCoState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return NoLoCoState(params, zeros, jnp.zeros([], jnp.int32))

    def send(params: Params, state: NoLoCoState, i: int = 0):
        values = {"drift": tree_sub(params, state.anchor), "anchor": state.anchor}
        return gossip_payload(values, state.count), state

    def apply(params: Params, state: NoLoCoState, i: int, reduced):
        f32 = lambda x: x.astype(jnp.float32)

        def velocity(m, phi, g_bar, phi_bar):  # float32, cast where it is stored
            return mu * f32(m) + eta * f32(g_bar) + eta * (f32(phi_bar) - f32(phi))

        new = jax.tree.map(velocity, state.momentum, state.anchor, *_split(reduced))
        anchor = jax.tree.map(lambda phi, v: (f32(phi) + v).astype(phi.dtype), state.anchor, new)
        momentum_ = jax.tree.map(lambda m, v: v.astype(m.dtype), state.momentum, new)
        return anchor, NoLoCoState(anchor, momentum_, state.count + 1)

    return OuterOptimizer(
        init, send, reducer, apply, SYNCHRONOUS, replica_local=True, period=sync_every
    )


@register("gossip outer steps in random groups of n: no all-reduce")
@dataclasses.dataclass(frozen=True)
class NoLoCoSettings(Settings, StepSize):
    """NoLoCo's settings: step size and the gossip group (arXiv 2506.10911)."""

    algorithm: str = setting("noloco", "the algorithm")
    group_size: int = setting(2, "replicas per gossip group (>= 1; divides the replicas)")

    def check(self, bounds) -> None:
        if self.group_size < 1:
            fail("group_size", self.group_size, "must be >= 1")
        if bounds.replicas is not None and bounds.replicas % self.group_size:
            fail(
                "group_size",
                self.group_size,
                f"must divide mesh.replica={bounds.replicas} (replicas are dealt into groups)",
            )

    def build(self, context, reduce) -> OuterOptimizer:
        return noloco(
            self.learning_rate, self.momentum, self.group_size, sync_every=context.sync_every
        )
