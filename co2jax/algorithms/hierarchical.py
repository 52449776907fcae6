"""Hierarchical DiLoCo: an outer step inside each region every round, and one across the
regions every K rounds (the synchronous two-level rule of HALoS, Kim et al., ICML 2025)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_int, check_transform, check_unit_interval
from co2jax.algorithms.outer_schedules import outer_transform
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import OuterStep, Settings, fail, setting
from co2jax.axes import REPLICA
from co2jax.comm.regions import global_payload, region_payload, slow_link_bytes, two_level_mean
from co2jax.protocol import SYNCHRONOUS, OuterOptimizer, Params, StateRoles, checked_roles
from co2jax.tree import tree_bytes, tree_select, tree_sub


@checked_roles
class HierarchicalState(NamedTuple):
    """State of :func:`hierarchical_diloco` (one per replica).

    Attributes:
      anchor: phi_g, the parameters of this replica's region (its local parameter server):
        equal inside a region, different between regions unless ``alpha`` is 1.
      region_state: the region-level optimizer's state (equal inside a region).
      reference: ref_g, the region's parameters after its last global merge.
      global_params: theta, the global parameters (equal on every replica).
      global_state: the global optimizer's state (equal on every replica).
      count: 0-d int32, rounds taken (replica-invariant: it selects the global rounds).
    """

    anchor: Params
    region_state: optax.OptState
    reference: Params
    global_params: Params
    global_state: optax.OptState
    count: jax.Array

    ROLES = StateRoles("anchor", advances=("count",))


def hierarchical_diloco(
    region_optimizer: optax.GradientTransformation,
    global_optimizer: optax.GradientTransformation,
    *,
    regions: int,
    global_every: int,
    alpha: float = 1.0,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """Two-level DiLoCo: a region outer step every round (H inner steps) over the fast links,
    a global one every ``K = global_every`` rounds (``K H`` inner steps) over the slow links.

    The R replicas form G regions of R / G contiguous replicas (:mod:`co2jax.comm.regions`).
    With ``x_r`` replica r's parameters after its H inner steps and g its region, every
    round:

    .. math::

        \\phi_g \\leftarrow \\phi_g + \\mathrm{OuterL}\\big(\\operatorname{mean}_{r \\in g}
            (\\phi_g - x_r)\\big)

    and after rounds K, 2K, ... (``count mod K = K - 1``), with ``U_g = ref_g - phi_g`` the
    region's progress since its last merge:

    .. math::

        \\theta &\\leftarrow \\theta + \\mathrm{OuterG}\\big(\\operatorname{mean}_g U_g\\big) \\\\
        \\phi_g &\\leftarrow (1 - \\alpha)\\,\\phi_g + \\alpha\\,\\theta, \\qquad
        ref_g \\leftarrow \\phi_g

    Every replica then restarts from ``phi_g``. Two transfers per round, in order: the region
    mean (``(m - 1)`` payloads per replica by collective-permutes inside the region), then the
    global mean of ``U_g``, whose all-reduce runs only in the global rounds (a ``lax.cond`` on
    the round count). Each level has its own optax optimizer and state, so its own schedule:
    the region one's steps count rounds, the global one's count global rounds.

    Reductions (tested): one region is DiLoCo with ``region_optimizer`` when the global step is
    ``optax.sgd(1)`` (any K and alpha); one replica per region with ``region_optimizer =
    optax.sgd(1)``, ``alpha = 1``, is DiLoCo over the regions at ``K H`` inner steps with
    ``global_optimizer``.

    This is the synchronous case of HALoS's rule as its released code applies it (a region's
    server merges ``alpha`` of the global parameters, ``--model_merge_weight``); the released
    system is asynchronous (arrivals applied one by one by delayed Nesterov, no barrier),
    which needs a time model and is not provided.

    Args:
      region_optimizer: OuterL, any optax transform on the region's mean pseudo-gradient.
      global_optimizer: OuterG, any optax transform on the regions' mean progress.
      regions: G (divides R).
      global_every: K, rounds per global step (>= 1).
      alpha: the weight of the global parameters in a region's merge, in (0, 1].
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.hierarchical_diloco(optax.sgd(1.0), optax.sgd(1.0), regions=2,
      ...                                    global_every=2)
      >>> state = jax.vmap(outer.init)(jnp.zeros((4, 1)))
      >>> sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
      >>> params, state = sync(jnp.array([[1.0], [3.0], [5.0], [7.0]]), state)
      >>> params.ravel()  # round 0: each region takes its own mean
      Array([2., 2., 6., 6.], dtype=float32)
      >>> params, state = sync(params + 1.0, state)
      >>> params.ravel()  # round 1: the global step merges the regions
      Array([5., 5., 5., 5.], dtype=float32)

    References:
      Kim et al., "HALoS: Hierarchical Asynchronous Local SGD over Slow Networks for
      Geo-Distributed Large Language Model Training", ICML 2025 (arXiv 2506.04531).
    """
    check_transform("region_optimizer", region_optimizer)
    check_transform("global_optimizer", global_optimizer)
    regions = check_int("regions", regions, 1)
    every = check_int("global_every", global_every, 1)
    alpha = check_unit_interval("alpha", alpha, closed_right=True)
    if alpha == 0:
        raise ValueError(f"alpha must be a number in (0, 1], got alpha={alpha!r}")
    check_axis_name("axis_name", axis_name)
    reducer = two_level_mean(regions, every, axis_name)

    def init(params: Params) -> HierarchicalState:
        copy = lambda: jax.tree.map(jnp.copy, params)  # own buffers: a state may be donated
        return HierarchicalState(
            params,
            region_optimizer.init(params),
            copy(),
            copy(),
            global_optimizer.init(params),
            jnp.zeros([], jnp.int32),
        )

    def send(params: Params, state: HierarchicalState, i: int = 0):
        if i == 0:
            return region_payload(tree_sub(state.anchor, params)), state
        return global_payload(tree_sub(state.reference, state.anchor), state.count), state

    def region_step(state: HierarchicalState, reduced) -> HierarchicalState:
        updates, region_state = region_optimizer.update(reduced, state.region_state, state.anchor)
        anchor = optax.apply_updates(state.anchor, updates)
        return state._replace(anchor=anchor, region_state=region_state)

    def global_step(state: HierarchicalState, reduced) -> HierarchicalState:
        updates, global_state = global_optimizer.update(
            reduced, state.global_state, state.global_params
        )
        theta = optax.apply_updates(state.global_params, updates)
        merged = jax.tree.map(
            lambda phi, th: ((1.0 - alpha) * phi.astype(jnp.float32) + alpha * th).astype(
                phi.dtype
            ),
            state.anchor,
            theta,
        )
        return state._replace(
            anchor=merged, reference=merged, global_params=theta, global_state=global_state
        )

    def apply(params: Params, state: HierarchicalState, i: int, reduced):
        if i == 0:
            state = region_step(state, reduced)
            return state.anchor, state
        now = state.count % every == every - 1
        state = tree_select(now, global_step(state, reduced), state)
        state = state._replace(count=state.count + 1)
        return state.anchor, state

    return OuterOptimizer(
        init, send, reducer, apply, SYNCHRONOUS * 2, replica_local=True, period=None
    )


@register("an outer step inside each region, and across regions every K rounds")
@dataclasses.dataclass(frozen=True)
class HierarchicalSettings(Settings, OuterStep):
    """Hierarchical DiLoCo's settings: the region-level outer step (the shared outer-step
    piece: lr, momentum, optimizer, schedules), the regions, and the global step."""

    algorithm: str = setting("hierarchical_diloco", "the algorithm")
    regions: int = setting(2, "G, regions of contiguous replicas (divides the replicas)")
    global_every: int = setting(4, "K, rounds between global outer steps (>= 1)")
    global_learning_rate: float = setting(1.0, "the global outer step's learning rate")
    global_momentum: float = setting(0.0, "the global outer step's Nesterov momentum, in [0, 1)")
    alpha: float = setting(1.0, "the global parameters' weight in a region's merge, in (0, 1]")

    def check(self, bounds) -> None:
        if self.regions < 1:
            fail("regions", self.regions, "must be >= 1")
        if bounds.replicas is not None and bounds.replicas % self.regions:
            fail(
                "regions",
                self.regions,
                f"must divide mesh.replica={bounds.replicas} (regions of equal size)",
            )
        if self.global_every < 1:
            fail("global_every", self.global_every, "must be >= 1 (rounds)")
        if self.global_learning_rate <= 0:
            fail("global_learning_rate", self.global_learning_rate, "must be > 0")
        if not 0 <= self.global_momentum < 1:
            fail("global_momentum", self.global_momentum, "must be in [0, 1)")
        if not 0 < self.alpha <= 1:
            fail("alpha", self.alpha, "must be in (0, 1]")

    def slow_link_bytes(self, params, replicas: int) -> float:
        """The global level's all-reduce of a model copy, per round (1 / K of it)."""
        return slow_link_bytes(tree_bytes(params), replicas, self.global_every)

    def build(self, context, reduce) -> OuterOptimizer:
        return hierarchical_diloco(
            self.transform(context),
            outer_transform("sgd", self.global_learning_rate, self.global_momentum, nesterov=True),
            regions=self.regions,
            global_every=self.global_every,
            alpha=self.alpha,
        )
