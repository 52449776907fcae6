"""CoCoDC, reconstructed: Streaming DiLoCo with a delay-compensated merge (arXiv 2504.17672).

**This is a reconstruction, not the paper's rule.** The paper describes a Taylor-expansion
delay compensation "using local parameter and delayed global parameter changes" and an
adaptive choice of which fragment to send, but publishes no formula for either. What this
module implements is documented in ``docs/algorithms/cocodc.md``; the closest published rule
is LOSCAR-SGD's merge ``x <- m_bar + (z - y)`` (``y`` the local value at the send, ``z`` now).

Streaming DiLoCo (:func:`co2jax.streaming_diloco`) sends fragment p's pseudo-gradient at
step ``s_p - tau`` and applies the reduced mean at ``s_p``; by then every replica has taken
``tau`` more inner steps on that fragment, which its merge ``alpha * x + (1 - alpha) *
theta~`` partly discards. CoCoDC records each replica's fragment values at the send and
carries the drift since then onto the new global copy. Per replica r and fragment p:

.. math::

    y_{r} &= \\theta_{r,p} \\quad\\text{(at step } s_p - \\tau\\text{; sent: }
        \\Delta_r = \\tilde\\theta_p - y_r) \\\\
    \\tilde\\theta_p &\\leftarrow \\tilde\\theta_p + \\mathrm{OuterOpt}_p(\\bar\\Delta),
        \\quad \\bar\\Delta = \\operatorname{mean}_r \\Delta_r
        \\quad\\text{(at step } s_p\\text{, as in Streaming DiLoCo)} \\\\
    d_r &= \\theta_{r,p} - y_r \\quad\\text{(the drift of the } \\tau \\text{ overlapped
        steps)} \\\\
    c_r &= \\tilde\\theta_p + d_r \\;\\;(\\text{zeroth}), \\qquad
        c_r = \\tilde\\theta_p + d_r + \\lambda\\, \\bar\\Delta \\odot \\bar\\Delta \\odot d_r
        \\;\\;(\\text{first}) \\\\
    \\theta_{r,p} &\\leftarrow \\alpha\\, \\theta_{r,p} + (1 - \\alpha)\\, c_r

``correction="none"`` takes ``c_r = theta~_p``: Streaming DiLoCo exactly. The merge weight
``alpha`` mixes the local values with the *corrected* global copy, so ``alpha = 0`` gives
``c_r`` exactly and ``alpha = 1`` leaves the local values untouched, as in Streaming DiLoCo.
With tau = 0 the drift is zero and every correction is Streaming DiLoCo.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_choice
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    Compression,
    Fragmented,
    OuterStep,
    Settings,
    fail,
    setting,
)
from co2jax.algorithms.streaming_diloco import StreamingState, streaming_diloco
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer
from co2jax.fragments import Fragments
from co2jax.protocol import OuterOptimizer, StateRoles, checked_roles

Params = Any
CORRECTIONS = ("none", "zeroth", "first")


@checked_roles
class CoCoDCState(NamedTuple):
    """State of :func:`cocodc` (one per replica).

    Attributes:
      streaming: the Streaming DiLoCo state (:class:`co2jax.StreamingState`: every
        fragment's global copy, its outer-optimizer state, the sync count).
        Replica-invariant.
      sent: per fragment, this replica's values of the fragment at its last send (a list of
        arrays, one per piece, in the parameters' dtypes; the initial values before the
        first send); ``()`` with ``correction="none"``. Replica-varying.
    """

    streaming: StreamingState
    sent: tuple[Any, ...]

    ROLES = StateRoles(replica_varying=("sent",), wraps="streaming")


def _check_hessian_scale(value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value >= 0):
        raise ValueError(f"hessian_scale must be a finite number >= 0, got hessian_scale={value!r}")
    return float(value)


# Why the correction is computed at the apply, from a value recorded at the send.
#
# Between the send (step s_p - tau) and the apply (step s_p) replica r takes tau inner steps
# on fragment p, from y_r to x_r = y_r + d_r. The outer step on mean_r Delta_r was computed
# from where the replicas were at the send; Streaming DiLoCo lands it on the global copy and
# merges, so the tau steps' progress survives only through alpha. Had the new global copy
# theta~' been there at the send, the replica would now sit near theta~' + d_r: that is the
# zeroth-order correction (LOSCAR-SGD's merge). With alpha the merge becomes
#     x_r <- alpha * x_r + (1 - alpha) * (theta~' + d_r) = x_r + (1 - alpha) * (theta~' - y_r),
# i.e. the replica moves by what the global copy moved past the point it sent from.
#
# First order (DC-ASGD's Taylor step, arXiv 1609.08326): the tau steps were taken with
# gradients of a model that had not seen the outer update yet. DC-ASGD approximates the
# Hessian's diagonal by lambda * g (.) g from a gradient g; here g is the fragment's averaged
# pseudo-gradient mean_r Delta_r, the one gradient estimate every replica shares (replica-
# invariant, no extra communication; only g (.) g enters, so its sign is immaterial), and the
# term lambda * g (.) g (.) d_r enlarges the drift element-wise. This form is a choice, not a
# derivation: replaying the tau steps from theta~' instead of y gives, to first order,
# d_r - lr * tau * hess(f) (theta~' - y_r), a term in theta~' - y_r (not implemented).
#
# Both corrections are element-wise, so a data-sharded outer state (each device holding a
# shard of the fragment) computes them shard by shard with no collective.


def cocodc(
    outer_optimizer: optax.GradientTransformation,
    fragments: Fragments,
    sync_every: int,
    tau: int = 1,
    alpha: float = 0.5,
    correction: str = "zeroth",
    hessian_scale: float = 0.5,
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
) -> OuterOptimizer:
    """CoCoDC (reconstructed): Streaming DiLoCo whose merge carries the drift since the send.

    .. math::

        \\theta_{r,p} \\leftarrow \\alpha\\,\\theta_{r,p} + (1-\\alpha)\\,\\big(\\tilde\\theta_p
            + (1 + \\lambda\\,\\bar\\Delta_p \\odot \\bar\\Delta_p) \\odot
            (\\theta_{r,p} - y_{r,p})\\big)

    at fragment p's apply step, after Streaming DiLoCo's outer step on its global copy
    ``theta~_p``; ``y_{r,p}`` is replica r's fragment at the send step, ``tau`` steps before,
    and ``Delta-bar_p`` the reduced pseudo-gradient. ``lambda = hessian_scale`` for
    ``correction="first"``, 0 for ``"zeroth"``; ``"none"`` merges with ``theta~_p`` alone
    (Streaming DiLoCo). The schedule, payloads and collectives are Streaming DiLoCo's: the
    correction is local. The paper gives no formula: see ``docs/algorithms/cocodc.md`` for
    what is reconstructed and what is verified.

    Args:
      outer_optimizer: the outer optax transform, one state per fragment (e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      fragments: from :func:`co2jax.fragments.make_fragments` on the parameters.
      sync_every: H, inner steps between two syncs of the same fragment (a round).
      tau: inner steps between sending a fragment's pseudo-gradient and applying it
        (``0 <= tau < H / P``); tau = 0 leaves no drift to correct.
      alpha: the merge weight of the local values, in [0, 1], applied as in Streaming
        DiLoCo but against the corrected global copy.
      correction: ``"zeroth"`` (carry the drift), ``"first"`` (carry it enlarged by the
        Taylor term) or ``"none"`` (Streaming DiLoCo).
      hessian_scale: lambda, the scale of the diagonal Hessian proxy ``lambda * g (.) g`` of
        ``correction="first"`` (>= 0; unused otherwise). It is not scale-free: ``g`` is a
        parameter difference, so ``lambda * g (.) g`` is small where pseudo-gradients are.
      axis_name: the replica axis.
      reduce: the reduction of one fragment's payload (default: mean over ``axis_name``).

    Returns:
      An :class:`~co2jax.OuterOptimizer` with :class:`CoCoDCState`, Streaming DiLoCo's
      schedule (one transfer per fragment, sent ``tau`` steps before its apply).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> frags = co2jax.fragments.make_fragments({"w": jnp.zeros(1)}, 1)
      >>> outer = co2jax.cocodc(optax.sgd(1.0), frags, sync_every=2, tau=1, alpha=0.0)
      >>> tx = co2jax.local_updates(optax.sgd(1.0), outer, sync_every=2)
      >>> params = {"w": jnp.zeros((2, 1))}          # two replicas
      >>> grads = {"w": jnp.array([[1.0], [3.0]])}   # a fixed gradient each
      >>> state = jax.vmap(tx.init)(params)
      >>> step = jax.jit(jax.vmap(tx.update, axis_name="replica"))
      >>> for _ in range(2):  # sent after step 1 (-1, -3), applied after step 2 (-2, -6)
      ...     updates, state = step(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"][:, 0]  # the new global copy -2 plus each drift since the send
      Array([-3., -5.], dtype=float32)

    References:
      "Cross-region Model Training with Communication-Computation Overlapping and Delay
      Compensation", arXiv 2504.17672 (CoCoDC; no formula published).
      "Streaming DiLoCo with overlapping communication", arXiv 2501.18512.
      "Asynchronous Stochastic Gradient Descent with Delay Compensation", arXiv 1609.08326
      (DC-ASGD: the g (.) g Hessian proxy).
    """
    correction = check_choice("correction", correction, CORRECTIONS)
    hessian_scale = _check_hessian_scale(hessian_scale)
    # validates the rest (outer_optimizer, fragments, sync_every, tau, alpha, axis_name)
    streaming = streaming_diloco(
        outer_optimizer, fragments, sync_every, tau, alpha, axis_name=axis_name, reduce=reduce
    )
    alpha = float(alpha)
    keeps_sent = correction != "none"

    def init(params: Params) -> CoCoDCState:
        inner = streaming.init(params)
        sent = ()
        if keeps_sent:  # the initial values: every apply is preceded by its send; copies,
            # not the anchor's buffers (a donated state must hold no buffer twice)
            taken = (fragments.take(params, p) for p in range(fragments.count))
            sent = tuple(jax.tree.map(jnp.copy, t) for t in taken)
        return CoCoDCState(inner, sent)

    def send(params: Params, state: CoCoDCState, p: int):
        payload, inner = streaming.send(params, state.streaming, p)
        sent = state.sent
        if keeps_sent:
            sent = (*sent[:p], fragments.take(params, p), *sent[p + 1 :])
        return payload, CoCoDCState(inner, sent)

    def apply(params: Params, state: CoCoDCState, p: int, reduced: Any):
        now = fragments.take(params, p)
        merged, inner = streaming.apply(params, state.streaming, p, reduced)
        if not keeps_sent:
            return merged, CoCoDCState(inner, state.sent)
        new_global = fragments.take(inner.anchor, p)
        corrected = []
        for x, y, g_new, g in zip(now, state.sent[p], new_global, reduced, strict=True):
            x32 = x.astype(jnp.float32)
            drift = x32 - y.astype(jnp.float32)
            if correction == "first":
                g = g.astype(jnp.float32)
                drift = drift + hessian_scale * g * g * drift
            target = g_new.astype(jnp.float32) + drift
            corrected.append((alpha * x32 + (1.0 - alpha) * target).astype(x.dtype))
        return fragments.put(merged, p, corrected), CoCoDCState(inner, state.sent)

    return streaming._replace(init=init, send=send, apply=apply)


@register("Streaming DiLoCo with delay compensation at apply (a reconstruction)")
@dataclasses.dataclass(frozen=True)
class CoCoDCSettings(Settings, OuterStep, Fragmented, Compression):
    """CoCoDC's settings: Streaming DiLoCo's and the delay compensation."""

    algorithm: str = setting("cocodc", "the algorithm")
    correction: str = setting("zeroth", "the delay compensation", CORRECTIONS)
    hessian_scale: float = setting(0.5, "lambda of the first-order correction (>= 0)")

    def check(self, bounds) -> None:
        if self.hessian_scale < 0:
            fail("hessian_scale", self.hessian_scale, "must be >= 0")

    def build(self, context, reduce) -> OuterOptimizer:
        return cocodc(
            self.transform(context), self.cut(context), context.sync_every, self.tau,
            self.alpha, self.correction, self.hessian_scale, reduce=reduce,
        )  # fmt: skip
