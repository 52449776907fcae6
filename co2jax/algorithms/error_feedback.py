"""Error feedback: what compression leaves out of a payload is kept and sent later.

Per replica and per transfer of the schedule (one residual each: the whole tree for DiLoCo,
one per fragment for Streaming DiLoCo), at the transfer's send step:

.. math::

    t = \\Delta + \\beta e, \\qquad c = D(C(t)), \\qquad e \\leftarrow t - c

and ``c`` is what crosses the wire. The residual is computed when the payload is *sent*, from
that payload: with Streaming DiLoCo's ``tau >= 1`` the parameters move between the send and
the apply, and a residual recomputed at the apply would not be what was left out of what was
sent.

Where the reducer has a gather form (every all-gather reducer) the wrapper sends the encoding
itself (:class:`co2jax.comm.Encoded`): the reducer gathers it as it is, with no second
encoding, and a top-k encoding keeps its support (a selected value that quantizes to zero is
still selected). A reducer without one (the two-step compressed all-reduce) says what it
transmits for a payload (``reducer.roundtrip``: its encoding decoded, in its own block
layout; the two-step collective's blocks start at each group's first element, and its shards
are whole blocks); the wrapper takes ``c`` from there and sends it decoded, and the reducer
re-encodes it to the same codes: every block codec is idempotent
(``C(D(C(x))) == C(x)``, to float32 rounding of a scale). So the mean's first quantization is
of exactly the ``c`` the residual was taken from; its second (of the mean) is not seen here.
Top-k is not idempotent (ties among zeros), so it is refused there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_positive, check_unit_interval
from co2jax.comm.reducer import Encoded
from co2jax.protocol import OuterOptimizer, Params, StateRoles, checked_roles, payload_shapes


@checked_roles
class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
      inner_state: the wrapped algorithm's state.
      residuals: per transfer of the schedule, what compression has left out so far, shaped
        like that transfer's payload (float32). Replica-varying.
    """

    inner_state: Any
    residuals: tuple[Any, ...]

    ROLES = StateRoles(replica_varying=("residuals",), wraps="inner_state")


def error_feedback(outer: OuterOptimizer, decay: float = 1.0, scale: float = 1.0) -> OuterOptimizer:
    """``outer`` with its compressed payloads sent with error feedback (residual per replica).

    .. math::

        c_r = \\operatorname{D}(\\operatorname{C}(s \\Delta_r + \\beta e_r)), \\qquad
        e_r \\leftarrow s \\Delta_r + \\beta e_r - c_r

    ``outer``'s reducer must be compressed (``outer.reducer.codec`` set, e.g.
    :func:`co2jax.comm.all_gather_compressed`) and say what it transmits: its gather form
    (``encode``, sent as it is) or ``roundtrip`` (:func:`co2jax.comm.all_reduce_compressed`:
    ``c`` is what it puts on the wire, in its own block layout, sent decoded). ``decay`` is
    ``beta`` (1 = classic error feedback; SparseLoCo uses 0.95). ``scale`` is ``s`` (1;
    MuLoCo's released code puts the outer learning rate there, so the outer step sees ``s``
    times the pseudo-gradient).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> from co2jax import comm
      >>> reduce = comm.all_gather_compressed(comm.topk(1, chunk=2))
      >>> outer = co2jax.error_feedback(co2jax.diloco(optax.sgd(1.0), reduce=reduce))
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 2)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[-1.0, -0.5], [-1.0, -0.5]]), state)
      >>> params[0], state.residuals[0][0]  # the 0.5 left out waits for the next round
      (Array([-1.,  0.], dtype=float32), Array([0. , 0.5], dtype=float32))
    """
    decay = check_unit_interval("decay", decay, closed_right=True)
    scale = check_positive("scale", scale)
    reducer = outer.reducer
    if reducer.codec is None:
        raise ValueError(
            f"error_feedback needs a compressed reducer (with a codec), got outer.reducer="
            f"{reducer.name!r}"
        )
    if reducer.encode is None and reducer.codec.sparse:
        raise ValueError(
            f"error feedback through {reducer.name} would re-encode a top-k payload and lose "
            "its support; use an all-gather reducer (co2jax.comm.all_gather_topk)"
        )
    if reducer.encode is None and reducer.roundtrip is None:
        raise ValueError(
            f"error feedback needs to know what outer.reducer={reducer.name!r} transmits: give "
            "it a gather form (encode) or a roundtrip"
        )

    def compress(target: Any) -> tuple[Any, Any]:
        """(what is sent, its decoded value)."""
        if reducer.encode is not None:
            encoded = reducer.encode(target)
            return encoded, encoded.decode()

        # the reducer's own encoding, in its block layout: what it will transmit
        decoded = reducer.roundtrip(target)
        return decoded, decoded

    def init(params: Params) -> ErrorFeedbackState:
        inner = outer.init(params)
        residuals = []
        for i in range(len(outer.schedule)):
            shapes = payload_shapes(outer, params, inner, i)
            residuals.append(jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes))
        return ErrorFeedbackState(inner, tuple(residuals))

    def send(params: Params, state: ErrorFeedbackState, i: int):
        payload, inner = outer.send(params, state.inner_state, i)
        target = jax.tree.map(
            lambda x, e: scale * x.astype(jnp.float32) + decay * e, payload, state.residuals[i]
        )
        sent, decoded = compress(target)
        residual = jax.tree.map(lambda t, c: t - c.astype(jnp.float32), target, decoded)
        dtypes = tuple(str(jnp.dtype(x.dtype)) for x in jax.tree.leaves(payload))
        if isinstance(sent, Encoded):  # decodes to the payload's dtypes
            sent = Encoded(sent.data, dataclasses.replace(sent.form, dtypes=dtypes))
        else:  # decoded values, in the payload's dtypes
            sent = jax.tree.map(lambda c, x: c.astype(x.dtype), sent, payload)
        residuals = (*state.residuals[:i], residual, *state.residuals[i + 1 :])
        return sent, ErrorFeedbackState(inner, residuals)

    def apply(params: Params, state: ErrorFeedbackState, i: int, reduced: Any):
        new_params, inner = outer.apply(params, state.inner_state, i, reduced)
        return new_params, state._replace(inner_state=inner)

    return outer._replace(init=init, send=send, apply=apply)
