"""CO2: local updating with a one-round-stale asynchronous all-reduce (arXiv 2401.16265)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from co2jax import penalties as _penalties
from co2jax._checks import check_positive, check_unit_interval
from co2jax.algorithms.fused import Fusable, FusableTransformation
from co2jax.algorithms.pseudo_gradient import pseudo_gradient_method
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Fused, Guard, Settings, StepSize, fail, setting
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer
from co2jax.kernels.spec import OuterUpdateSpec
from co2jax.protocol import OuterOptimizer, find_state

MODES = ("paper", "reference_code")


class CO2MomentumState(NamedTuple):
    """State of :func:`scale_by_co2_momentum` (replica-invariant).

    Attributes:
      momentum: the outer momentum ``m`` (clipped when ``clip_threshold`` is set).
      penalty_state: the staleness penalty's own state (``EmptyPenaltyState`` when none).
      penalty_scale: 0-d float32, the mean multiplier ``Lambda`` of the last outer step (1
        with no penalty): how strongly staleness was damped, for logging.
      count: with a learning-rate or momentum schedule, the outer steps taken so far (the
        schedules' argument); ``None`` otherwise.
    """

    momentum: optax.Updates
    penalty_state: Any
    penalty_scale: jax.Array
    count: Any = None  # with a schedule: 0-d int32, the outer steps taken (else None)


def _scale(multiplier: Any, tree: Any) -> Any:
    """Multiplies ``tree`` by a scalar or by a same-structure pytree, keeping leaf dtypes."""
    if jax.tree.structure(multiplier) == jax.tree.structure(tree):
        return jax.tree.map(lambda m, x: (m * x).astype(x.dtype), multiplier, tree)
    return jax.tree.map(lambda x: (multiplier * x).astype(x.dtype), tree)


def _mean_multiplier(multiplier: Any, tree: Any) -> jax.Array:
    """The element-weighted mean of a scalar or per-element multiplier."""
    if jax.tree.structure(multiplier) != jax.tree.structure(tree):
        return jnp.asarray(multiplier, jnp.float32).mean()
    leaves = jax.tree.leaves(multiplier)
    total = sum(
        jnp.sum(jnp.broadcast_to(m, x.shape).astype(jnp.float32))
        for m, x in zip(leaves, jax.tree.leaves(tree), strict=True)
    )
    return total / max(1, sum(x.size for x in jax.tree.leaves(tree)))


def scale_by_co2_momentum(
    learning_rate: optax.ScalarOrSchedule,
    momentum: optax.ScalarOrSchedule,
    clip_threshold: float | None = None,
    penalty: _penalties.Penalty | None = None,
) -> optax.GradientTransformation:
    """CO2's outer step on the (stale) averaged pseudo-gradient ``g``, anchor as ``params``.

    ``m <- clip(beta*m + Lambda*g, -phi, phi)``; the update is ``-alpha*m``. The previous
    anchor handed to the penalty is ``theta^(t) + alpha_(t-1)*m_(t-1)``: the last update
    undone.

    ``learning_rate`` and ``momentum`` may be optax schedules of the outer step count ``t``
    (0 at the first outer step), or arrays: ``optax.inject_hyperparams`` keeps them in the
    state, to change at run time (see :func:`co2jax.co2`).

    With fixed numbers and no penalty, a constant or the gap-aware one, the result also
    describes itself to the fused outer update
    (:class:`~co2jax.algorithms.fused.FusableTransformation`).
    """
    scheduled = callable(learning_rate) or callable(momentum)
    at = lambda value, t: value(t) if callable(value) else value

    def init(params):
        pstate = penalty.init(params) if penalty is not None else _penalties.EmptyPenaltyState()
        return CO2MomentumState(
            jax.tree.map(jnp.zeros_like, params),
            pstate,
            jnp.ones([], jnp.float32),
            jnp.zeros([], jnp.int32) if scheduled else None,
        )

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_co2_momentum needs params (the anchor)")
        t = state.count
        alpha, beta = at(learning_rate, t), at(momentum, t)
        pstate, scale = state.penalty_state, jnp.ones([], jnp.float32)
        if penalty is not None:
            last = at(learning_rate, jnp.maximum(t - 1, 0)) if scheduled else alpha
            previous_anchor = jax.tree.map(lambda a, m: a + last * m, params, state.momentum)
            lam, pstate = penalty.update(params, previous_anchor, updates, pstate)
            updates = _scale(lam, updates)
            scale = _mean_multiplier(lam, updates)
        m = jax.tree.map(lambda m, g: (beta * m + g).astype(m.dtype), state.momentum, updates)
        if clip_threshold is not None:
            m = jax.tree.map(lambda x: jnp.clip(x, -clip_threshold, clip_threshold), m)
        out = jax.tree.map(lambda x: (-alpha * x).astype(x.dtype), m)
        count = None if t is None else optax.safe_increment(t)
        return out, CO2MomentumState(m, pstate, scale, count)

    kind = "none" if penalty is None else penalty.kind
    numbers = all(isinstance(v, (int, float)) for v in (learning_rate, momentum))
    if kind not in ("none", "constant", "gap_aware") or not numbers:
        return optax.GradientTransformation(init, update)
    options = dict(penalty.options) if penalty is not None else {}
    spec = OuterUpdateSpec(
        learning_rate,
        momentum,
        clip=clip_threshold,
        penalty=kind,
        penalty_scale=1.0 / options["lam"] if kind == "constant" else 1.0,
        gap_decay=options.get("decay", 0.9),
        gap_eps=options.get("eps", 1e-12),
    )
    gap_aware = kind == "gap_aware"

    def split(state):
        pstate = state.penalty_state
        return (
            state.momentum,
            (pstate.scale if gap_aware else None),
            (pstate.count if gap_aware else None),
        )

    def merge(state, m, gap, penalty_mean, applied):
        pstate = state.penalty_state
        if gap_aware:
            pstate = _penalties.GapAwareState(gap, pstate.count + applied.astype(jnp.int32))
        scale = jnp.where(applied, penalty_mean, state.penalty_scale)
        return CO2MomentumState(m, pstate, scale)

    return FusableTransformation(init, update, Fusable(spec, split, merge))


def co2(
    learning_rate: optax.ScalarOrSchedule,
    momentum: optax.ScalarOrSchedule,
    clip_threshold: float | None = None,
    penalty: _penalties.Penalty | Callable | None = None,
    mode: str = "paper",
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
    implementation: str = "auto",
) -> OuterOptimizer:
    """CO2: the outer update uses the previous round's averaged pseudo-gradient.

    ``mode="paper"`` (the algorithm of the paper). At the end of round t:

    .. math::

        m_t &= \\beta m_{t-1} + \\Lambda_t \\odot \\bar\\Delta^{(t-1)} \\\\
        m_t &= \\operatorname{clip}(m_t, -\\phi, \\phi) \\\\
        \\theta^{(t+1)} &= \\theta^{(t)} - \\alpha m_t

    with ``Delta-bar^(-1) = 0`` (the first round's progress lands one round late). Replicas
    restart from ``theta^(t+1)``; their ``Delta_r^(t)`` is reduced during round t+1, so the
    reduction can hide behind the inner steps (it is sent at step 0 and applied at the end).
    Clipping is an element-wise clamp of the momentum state and really clips.

    ``mode="reference_code"`` reproduces the released implementation: a synchronous average
    (``Delta-bar^(t)``, no delay), a constant penalty ``1/lambda``, and no clipping. The
    released code calls an out-of-place clamp and discards its result, so its clip is a
    no-op: a ``clip_threshold`` given in this mode is ignored (with a warning), as there.

    Args:
      learning_rate: ``alpha`` (> 0); released default 1.0. A number or an optax schedule
        of the outer step count (then the fused outer update is not used).
      momentum: ``beta`` in [0, 1); released default 0.5 (fairseq picks it by GPU count).
        A number or a schedule, as ``learning_rate``.
      clip_threshold: ``phi`` (> 0), or ``None`` for no clipping.
      penalty: ``Lambda``: ``None`` (none), a :class:`co2jax.penalties.Penalty` such as
        ``penalties.constant(lam)`` or ``penalties.gap_aware()``, or a callable
        ``fn(anchor, previous_anchor, stale_delta) -> multiplier``. ``reference_code`` mode
        accepts only ``None`` or a constant.
      mode: ``"paper"`` or ``"reference_code"``.
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).
      implementation: the fused outer update's (``"auto"``, ``"pallas"``, ``"interpret"``,
        ``"xla"``; :mod:`co2jax.kernels.api`). A custom callable penalty is not fusable and
        runs as plain jnp whatever this says.

    Returns:
      An :class:`~co2jax.OuterOptimizer` with
      :class:`~co2jax.algorithms.pseudo_gradient.PseudoGradientState` whose ``outer_state``
      is a :class:`CO2MomentumState`.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.co2(learning_rate=1.0, momentum=0.5, clip_threshold=1.5)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
      >>> params, state = sync(jnp.array([[1.0], [3.0]]), state)
      >>> params  # Delta-bar^(-1) = 0: nothing moves yet
      Array([[0.],
             [0.]], dtype=float32)
      >>> params, state = sync(params, state)  # applies -2, clipped to -1.5
      >>> params
      Array([[1.5],
             [1.5]], dtype=float32)

    References:
      Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
      Overlap", ICLR 2024, arXiv 2401.16265.
    """
    alpha, beta = learning_rate, momentum
    if callable(alpha):  # a schedule: its first value is checked
        check_positive("learning_rate (a schedule, at outer step 0)", float(alpha(0)))
    else:
        alpha = check_positive("learning_rate", alpha)
    if callable(beta):
        check_unit_interval("momentum (a schedule, at outer step 0)", float(beta(0)))
    else:
        beta = check_unit_interval("momentum", beta)
    if clip_threshold is not None:
        clip_threshold = check_positive("clip_threshold", clip_threshold)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")
    penalty = _penalties.as_penalty(penalty)
    if mode == "reference_code":
        if penalty is not None and penalty.kind != "constant":
            raise ValueError(
                "mode='reference_code' uses the released code's constant penalty; got "
                f"penalty={penalty!r}. Pass penalties.constant(lam) or None, or use mode='paper'."
            )
        if clip_threshold is not None:
            warnings.warn(
                f"co2(mode='reference_code') ignores clip_threshold={clip_threshold}: the "
                "released code's clip is a no-op (an out-of-place clamp whose result is "
                "discarded). Use mode='paper' for a clip that clips.",
                stacklevel=2,
            )
            clip_threshold = None
    outer = scale_by_co2_momentum(alpha, beta, clip_threshold, penalty)
    delay = 1 if mode == "paper" else 0
    return pseudo_gradient_method(
        outer, delay=delay, axis_name=axis_name, reduce=reduce, implementation=implementation
    )


PENALTIES = ("none", "constant", "gap_aware")


@register("CO2: stale outer momentum")
@dataclasses.dataclass(frozen=True)
class CO2Settings(Settings, StepSize, Fused, Guard):
    """CO2's settings: step size, clip, penalty and mode (arXiv 2401.16265)."""

    algorithm: str = setting("co2", "the algorithm")
    clip_threshold: float | None = setting(None, "clip of the stale momentum's step (paper)")
    penalty: str = setting("none", "the staleness penalty", PENALTIES)
    penalty_lambda: float = setting(1.0, "the constant penalty's lambda (> 0)")
    gap_decay: float = setting(0.9, "the gap-aware penalty's average decay, in [0, 1)")
    mode: str = setting("paper", "the paper's update or the released code's", MODES)

    def check(self, bounds) -> None:
        self.unless("penalty_lambda", self.penalty == "constant", "outer.penalty is 'constant'")
        self.unless("gap_decay", self.penalty == "gap_aware", "outer.penalty is 'gap_aware'")
        self.unless("clip_threshold", self.mode == "paper", "outer.mode is 'paper'")
        if not self.penalty_lambda > 0:
            fail("penalty_lambda", self.penalty_lambda, "must be > 0")
        if not 0 <= self.gap_decay < 1:
            fail("gap_decay", self.gap_decay, "must be in [0, 1)")
        if self.mode == "reference_code" and self.penalty == "gap_aware":
            fail("penalty", self.penalty, "outer.mode='reference_code' takes 'none' or 'constant'")
        if self.clip_threshold is not None and not self.clip_threshold > 0:
            fail("clip_threshold", self.clip_threshold, "must be > 0 or None")

    def metrics(self, state: Any) -> dict[str, Any]:
        """``clip_fraction``: the fraction of momentum elements at the clip bound (None
        without a clip); ``penalty_scale``: the staleness penalty's mean multiplier."""
        momentum = find_state(state, CO2MomentumState)
        if momentum is None:
            return {"clip_fraction": None, "penalty_scale": None}
        clip = self.clip_threshold if self.mode == "paper" else None
        fraction = None
        if clip is not None:
            fraction = float(_at_bound(momentum.momentum, clip * (1 - 1e-6)))
        return {
            "clip_fraction": fraction,
            "penalty_scale": float(np.asarray(momentum.penalty_scale).mean()),
        }

    def build(self, context, reduce) -> OuterOptimizer:
        penalty = {
            "none": None,
            "constant": _penalties.constant(self.penalty_lambda),
            "gap_aware": _penalties.gap_aware(self.gap_decay),
        }[self.penalty]
        clip = self.clip_threshold if self.mode == "paper" else None
        return co2(
            self.learning_rate, self.momentum, clip, penalty, self.mode, reduce=reduce,
            implementation=self.implementation,
        )  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)
def _at_bound(momentum: Any, bound: float) -> jax.Array:
    """The fraction of elements with ``|m| >= bound``, on device: the momentum is
    parameter-sized and stays where it is (one program per state shapes and bound)."""
    leaves = jax.tree.leaves(momentum)
    at = sum(jnp.sum(jnp.abs(x) >= bound) for x in leaves)
    return at / max(1, sum(x.size for x in leaves))
