"""DiLoCoX, as a documented reconstruction: one-step-delayed DiLoCo whose pseudo-gradients cross
the wire as low-rank int4 factors with error feedback, and a controller for rank and H.

What the paper (arXiv 2506.21263) describes: a one-step-delay overlap of the outer
communication with local training, compression of the pseudo-gradients by low rank and
quantization (int4, by a secondary summary), and a schedule that adapts the compression ratio
and the number of local steps H. It gives no rule for that schedule and no released code;
everything below beyond "delayed DiLoCo + low rank + int4" is ours
(docs/algorithms/diloco_x.md).

:func:`adapt` is the schedule as a pure controller (the rule and its hysteresis are in its
docstring); :func:`exchange_seconds` reads the exchange's time from a separate job's
:class:`co2jax.JobMetrics`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import optax

from co2jax._checks import check_int
from co2jax.algorithms.diloco import delayed_diloco
from co2jax.algorithms.guards import skip_nonfinite as guard
from co2jax.algorithms.low_rank import low_rank
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    Delay,
    Fused,
    Guard,
    OuterStep,
    Settings,
    fail,
    setting,
)
from co2jax.axes import REPLICA
from co2jax.comm.lowrank import FACTORS
from co2jax.protocol import OuterOptimizer


def diloco_x(
    outer_optimizer: optax.GradientTransformation,
    rank: int = 32,
    factors: str = "int4",
    delay: int = 1,
    *,
    decay: float = 1.0,
    block: int = 128,
    seed: int = 0,
    skip_nonfinite: bool = False,
    axis_name: str = REPLICA,
    implementation: str = "auto",
) -> OuterOptimizer:
    """DiLoCoX (reconstructed): delayed DiLoCo on low-rank, int4, error-fed pseudo-gradients.

    Per replica r and round t, with ``Delta_r^(t) = theta^(t) - theta_r^(t,H)``:

    .. math::

        T_r &= \\Delta_r^{(t-d)} + \\beta e_r, \\qquad
        \\hat T_r = D(C(P_r))\\, D(C(Q_r'))^\\top, \\qquad e_r \\leftarrow T_r - \\hat T_r \\\\
        \\theta^{(t+1)} &= \\theta^{(t)} + \\mathrm{OuterOpt}\\big(\\operatorname{mean}_r
            \\hat T_r\\big) \\quad (t \\ge d; \\ \\Delta^{(s)} = 0 \\text{ for } s < 0)

    per matrix leaf, ``(P_r, Q'_r)`` one warm-started power-iteration step on ``T_r``
    (:func:`co2jax.low_rank`), ``C``/``D`` int4 with a float32 scale per ``block``
    (``factors="int4"``). It is :func:`co2jax.delayed_diloco` wrapped by
    :func:`co2jax.low_rank`: the reduction of round t-d's factors is an all-gather sent
    before round t's inner steps, which hide it.

    Defaults (ours; the paper publishes none for rank or block): rank 32, int4 in blocks of
    128, classic error feedback (``decay=1``), delay 1. Run it with ``spread=False`` in
    :class:`co2jax.RoundTrainer` on TPU and in :func:`co2jax.local_updates` (the factors
    cannot be cut into chunks).

    Args:
      outer_optimizer: any optax transform on the (delayed) mean of the approximations; the
        DiLoCo recipe is Nesterov SGD, ``co2jax.outer_sgd(0.7, 0.9, nesterov=True)``.
      rank: r (>= 1).
      factors: ``"int4"``, ``"bf16"`` or ``"float32"`` (factors and dense leaves).
      delay: rounds between sending and applying (>= 0; 0 is DiLoCo with low rank).
      decay: the residual's decay beta in [0, 1].
      block: int4's elements per scale (even).
      seed: the seed of the first ``Q``.
      skip_nonfinite: put :func:`co2jax.skip_nonfinite` inside the low-rank wrapper (a
        skipped round keeps the residual and ``Q``, and ``pending`` still advances); do not
        wrap the result in it instead (the guard outside would also hold ``pending`` back).
      axis_name: the replica axis.
      implementation: the fused outer update's, used when ``outer_optimizer`` is fusable.

    Returns:
      An :class:`~co2jax.OuterOptimizer` with :class:`co2jax.LowRankState` around
      :class:`co2jax.PseudoGradientState` (around ``SkipNonfiniteState`` with
      ``skip_nonfinite``), scheduled :data:`co2jax.protocol.DELAYED` (``delay >= 1``).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.diloco_x(optax.sgd(1.0), rank=1)
      >>> state = jax.vmap(outer.init)({"w": jnp.zeros((2, 4, 8))})
      >>> sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
      >>> params, state = sync({"w": jnp.ones((2, 4, 8))}, state)
      >>> float(params["w"].max())  # nothing has arrived yet: one round of delay
      0.0
      >>> params, state = sync({"w": jnp.ones((2, 4, 8))}, state)
      >>> float(params["w"].mean())  # a rank-1 matrix: sent exactly (int4 of equal values)
      1.0

    References:
      DiLoCoX, arXiv 2506.21263 (no released rule for the schedule); PowerSGD,
      arXiv 1905.13133 (the low-rank step).
    """
    inner = delayed_diloco(
        outer_optimizer,
        check_int("delay", delay, 0),
        axis_name=axis_name,
        implementation=implementation,
    )
    if skip_nonfinite not in (True, False):
        raise ValueError(f"skip_nonfinite must be a bool, got skip_nonfinite={skip_nonfinite!r}")
    if skip_nonfinite:
        inner = guard(inner)
    return low_rank(
        inner, rank, factors=factors, decay=decay, block=block, seed=seed, axis_name=axis_name
    )


def _seconds(name: str, value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {name}={value!r}")
    return float(value)


def adapt(
    rank: int,
    sync_every: int,
    round_compute_s: float,
    exchange_s: float,
    *,
    min_rank: int = 1,
    max_rank: int | None = None,
    max_sync_every: int | None = None,
    min_sync_every: int | None = None,
) -> tuple[int, int]:
    """The next round's ``(rank, sync_every)`` from the last round's compute and exchange.

    The reconstructed rule (the paper states that DiLoCoX adapts both, not how). With a
    one-step delay a round's exchange hides behind the next round's compute while it takes
    no longer; so, with ``x = exchange_s / round_compute_s``:

    - ``x > 1`` (the exchange shows): halve the rank (``max(min_rank, rank // 2)``); at
      ``min_rank`` already, double H (up to ``max_sync_every``); at both limits, hold;
    - ``x < 1/2`` (the exchange would hide at twice its size): first halve H back towards
      ``min_sync_every`` (if given, and H is above it), else double the rank (up to
      ``max_rank``);
    - ``1/2 <= x <= 1``: hold.

    Hysteresis: the band [1/2, 1] is as wide as one step. Halving the rank at most halves
    the exchange (dense leaves and latency do not shrink), so a round that triggered it
    cannot land below 1/2; doubling the rank at most doubles it, so it cannot land above 1;
    doubling (halving) H doubles (halves) the compute. No step undoes the one before it.

    Args:
      rank: the rank of the round just run (>= min_rank).
      sync_every: its H (>= 1).
      round_compute_s: its inner steps' seconds (> 0; ``JobMetrics.compute_s``).
      exchange_s: its exchange's seconds (:func:`exchange_seconds`).
      min_rank: the lowest rank (>= 1).
      max_rank: the highest rank the rule raises to (``None``: no limit; a rank that saves
        nothing sends a leaf dense, which is delayed DiLoCo).
      max_sync_every: the largest H (``None``: no limit).
      min_sync_every: the H to come back to before raising the rank (``None``: H is never
        lowered).

    Returns:
      ``(rank, sync_every)`` for the next round.

    Example:
      >>> adapt(32, 100, round_compute_s=10.0, exchange_s=14.0)  # exposed: halve the rank
      (16, 100)
      >>> adapt(1, 100, 10.0, 14.0, max_sync_every=400)  # at min_rank: double H
      (1, 200)
      >>> adapt(16, 100, 10.0, 3.0, max_rank=32)  # slack: raise the rank
      (32, 100)
      >>> adapt(16, 100, 10.0, 7.0)  # in the band: hold
      (16, 100)
    """
    rank = check_int("rank", rank, 1)
    sync_every = check_int("sync_every", sync_every, 1)
    compute = _seconds("round_compute_s", round_compute_s)
    if compute <= 0:
        raise ValueError(f"round_compute_s must be > 0, got round_compute_s={round_compute_s!r}")
    exchange = _seconds("exchange_s", exchange_s)
    min_rank = check_int("min_rank", min_rank, 1)
    if max_rank is not None and check_int("max_rank", max_rank, min_rank) < rank:
        raise ValueError(f"max_rank must be >= rank={rank}, got max_rank={max_rank!r}")
    if rank < min_rank:
        raise ValueError(f"rank must be >= min_rank={min_rank}, got rank={rank!r}")
    if max_sync_every is not None and check_int("max_sync_every", max_sync_every, 1) < sync_every:
        raise ValueError(
            f"max_sync_every must be >= sync_every={sync_every}, got max_sync_every="
            f"{max_sync_every!r}"
        )
    if min_sync_every is not None and check_int("min_sync_every", min_sync_every, 1) > sync_every:
        raise ValueError(
            f"min_sync_every must be <= sync_every={sync_every}, got min_sync_every="
            f"{min_sync_every!r}"
        )
    if exchange > compute:
        if rank > min_rank:
            return max(min_rank, rank // 2), sync_every
        cap = max_sync_every if max_sync_every is not None else 2 * sync_every
        return rank, min(cap, 2 * sync_every)
    if exchange < compute / 2:
        if min_sync_every is not None and sync_every > min_sync_every:
            return rank, max(min_sync_every, sync_every // 2)
        cap = max_rank if max_rank is not None else 2 * rank
        return min(cap, 2 * rank), sync_every
    return rank, sync_every


def exchange_seconds(
    metrics: Any, link_bytes_per_s: float | None = None, *, min_wait_s: float = 0.0
) -> float:
    """The exchange's seconds in a delayed round of :class:`co2jax.JobTrainer`, from its
    :class:`co2jax.JobMetrics` (read by attribute: ``compute_s``, ``wait_s``,
    ``bytes_sent``).

    The payload is published before the inner steps and waited for after them, so an
    exchange that showed (``wait_s > min_wait_s``) took ``compute_s + wait_s``. One that hid
    took at most ``compute_s``, and the metrics do not say how much less: then
    ``bytes_sent / link_bytes_per_s`` where a link rate is known, else ``compute_s`` itself
    (an upper bound, which :func:`adapt` holds on: it never raises the rank on a guess).
    ``min_wait_s``: waits up to it count as hidden (the round's own fixed costs).

    Example:
      >>> from co2jax import JobMetrics
      >>> exchange_seconds(JobMetrics(None, compute_s=10.0, wait_s=4.0, round_s=14.2,
      ...                             bytes_sent=10**9))
      14.0
      >>> exchange_seconds(JobMetrics(None, 10.0, 0.0, 10.1, 10**9), link_bytes_per_s=4e8)
      2.5
    """
    compute = _seconds("metrics.compute_s", metrics.compute_s)
    wait = _seconds("metrics.wait_s", metrics.wait_s)
    if wait > _seconds("min_wait_s", min_wait_s):
        return compute + wait
    if link_bytes_per_s is not None:
        if not (isinstance(link_bytes_per_s, numbers.Real) and link_bytes_per_s > 0):
            raise ValueError(
                f"link_bytes_per_s must be > 0, got link_bytes_per_s={link_bytes_per_s!r}"
            )
        return float(metrics.bytes_sent) / float(link_bytes_per_s)
    return compute


@register("one-round-delayed DiLoCo on rank-r int4 pseudo-gradients (a reconstruction)")
@dataclasses.dataclass(frozen=True)
class DiLoCoXSettings(Settings, OuterStep, Delay, Fused, Guard):
    """DiLoCoX's settings: delayed DiLoCo's and the factors' rank and format."""

    algorithm: str = setting("diloco_x", "the algorithm")
    rank: int = setting(32, "the rank of each matrix's pseudo-gradient on the wire (>= 1)")
    factors: str = setting("int4", "the factors' format", FACTORS)

    def check(self, bounds) -> None:
        if self.rank < 1:
            fail("rank", self.rank, "must be >= 1")

    def build(self, context, reduce) -> OuterOptimizer:
        return diloco_x(
            self.transform(context), self.rank, self.factors, self.delay,
            skip_nonfinite=self.skip_nonfinite, implementation=self.implementation,
        )  # fmt: skip
