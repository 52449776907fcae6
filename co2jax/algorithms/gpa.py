"""GPA: AdamW with generalized primal averaging (arXiv 2512.17131), single-worker smoothed
DiLoCo.

Three sequences: z takes AdamW's steps, x averages z, and the gradient is taken at y, an
interpolation of the two. With ``mu_y`` (``train_interp_coeff`` in the released code) and
``mu_x`` (``eval_interp_coeff``), at step k = 1, 2, ...:

.. math::

    y_k &= \\mu_y x_k + (1 - \\mu_y) z_k, \\qquad g_k = \\nabla f(y_k) \\\\
    m &\\leftarrow \\beta_1 m + (1 - \\beta_1) g_k, \\quad
    v \\leftarrow \\beta_2 v + (1 - \\beta_2) g_k^2, \\quad
    u_k = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{v / (1 - \\beta_2^k)} + \\epsilon} \\\\
    z_{k+1} &= z_k - \\alpha_k u_k, \\qquad x_{k+1} = \\mu_x x_k + (1 - \\mu_x) z_{k+1}

The parameters the model holds are y (the gradient's point); x is never stored: with
c = 1 - mu_x, y is updated in place as y <- (1 - c) y + c z + alpha (mu_y (1 - c) - 1) u, then
z <- z - alpha u (the released code's form; equal to the three sequences, tested). Evaluate
at x = (y - (1 - mu_y) z) / mu_y (:func:`gpa_eval_params`).

Weight decay, two forms (``weight_decay_form``): ``"gradient"`` adds ``wd * y`` to u (the
released code up to commit 44aaa9f, which the port test reads); ``"z"`` decays z by
``1 - alpha wd`` before the step (a later release's default, from its description: that
version was not read here, nor its ``use_wd_on_y`` option, which is not provided). At
``mu_x = 0`` both are AdamW (``optax.adamw``), for any ``mu_y``.

No replica axis: one worker, like :func:`co2jax.snoo` (under data parallelism the gradient
is the replicas' mean). ``mu_x = 0.9^(1/H)`` matches DiLoCo with H inner steps per round
(the release's table, to four digits). Schedule-Free's averaging weights are not provided.

Example:
  >>> import jax, jax.numpy as jnp, optax, co2jax
  >>> tx = co2jax.gpa(0.1, mu_y=0.7, mu_x=0.9)
  >>> params = {"w": jnp.array([1.0, -2.0])}
  >>> state = tx.init(params)
  >>> grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
  >>> updates, state = tx.update(grads, state, params)
  >>> y = optax.apply_updates(params, updates)
  >>> [round(float(v), 4) for v in y["w"]]
  [0.963, -1.963]
  >>> [round(float(v), 4) for v in co2jax.gpa_eval_params(y, state, mu_y=0.7)["w"]]
  [0.99, -1.99]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_choice

WEIGHT_DECAY_FORMS = ("z", "gradient")


class GPAState(NamedTuple):
    """State of :func:`gpa`: ``count`` (steps taken, 0-d int32), ``mu`` and ``nu`` (Adam's
    moments, float32), ``z`` (the sequence AdamW steps, like the parameters)."""

    count: jax.Array
    mu: Any
    nu: Any
    z: Any


def _in(name: str, value: float, low: float, high: float, closed_low: bool = True) -> float:
    ok = (low <= value if closed_low else low < value) and value <= high
    if not isinstance(value, int | float) or isinstance(value, bool) or not ok:
        bracket = "[" if closed_low else "("
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {name}={value!r}")
    return float(value)


def gpa(
    learning_rate: float | Callable = 1e-3,
    *,
    mu_y: float = 0.7,
    mu_x: float = 0.9967,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_form: str = "z",
) -> optax.GradientTransformation:
    """GPA-AdamW as an optax transform of the gradient at y (see the module docstring).

    Args:
      learning_rate: alpha, a constant or an optax schedule of the step count.
      mu_y: the weight of x in y, in (0, 1] (the release's ``train_interp_coeff``, 0.7).
      mu_x: the weight of x in its own update, in [0, 1] (``eval_interp_coeff``, 0.9967).
      b1, b2, eps: Adam's.
      weight_decay: wd >= 0.
      weight_decay_form: ``"z"`` or ``"gradient"`` (module docstring).

    Returns:
      An ``optax.GradientTransformation`` whose updates take y to the next y; its state is
      :class:`GPAState`.
    """
    mu_y = _in("mu_y", mu_y, 0.0, 1.0, closed_low=False)
    mu_x = _in("mu_x", mu_x, 0.0, 1.0)
    b1, b2 = _in("b1", b1, 0.0, 1.0), _in("b2", b2, 0.0, 1.0)
    if b1 == 1.0 or b2 == 1.0:
        raise ValueError(f"b1 and b2 must be < 1, got b1={b1!r}, b2={b2!r}")
    if not eps >= 0 or not weight_decay >= 0:
        raise ValueError(f"eps and weight_decay must be >= 0, got {eps!r}, {weight_decay!r}")
    if not callable(learning_rate) and not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got learning_rate={learning_rate!r}")
    check_choice("weight_decay_form", weight_decay_form, WEIGHT_DECAY_FORMS)
    c = 1.0 - mu_x

    def init(params):
        zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.float32)
        return GPAState(
            jnp.zeros([], jnp.int32),
            jax.tree.map(zeros, params),
            jax.tree.map(zeros, params),
            jax.tree.map(jnp.asarray, params),
        )

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("gpa needs the parameters (y): call update(grads, state, params)")
        k = state.count + 1
        alpha = learning_rate(state.count) if callable(learning_rate) else learning_rate
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, grads)
        bc1, bc2 = 1 - b1 ** k.astype(jnp.float32), 1 - b2 ** k.astype(jnp.float32)

        def step(y, m, v, z):
            u = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
            y32, z32 = y.astype(jnp.float32), z.astype(jnp.float32)
            if weight_decay_form == "gradient":
                u = u + weight_decay * y32
            else:
                z32 = (1 - alpha * weight_decay) * z32
            y_next = (1 - c) * y32 + c * z32 + alpha * (mu_y * (1 - c) - 1) * u
            z_next = z32 - alpha * u
            return (y_next - y.astype(jnp.float32)).astype(y.dtype), z_next.astype(z.dtype)

        out = jax.tree.map(step, params, mu, nu, state.z)
        treedef = jax.tree.structure(params)
        pairs = treedef.flatten_up_to(out)
        updates = treedef.unflatten([p[0] for p in pairs])
        z = treedef.unflatten([p[1] for p in pairs])
        return updates, GPAState(k, mu, nu, z)

    return optax.GradientTransformation(init, update)


def gpa_eval_params(params: Any, state: GPAState, mu_y: float = 0.7) -> Any:
    """x, where GPA's model is evaluated: ``(y - (1 - mu_y) z) / mu_y`` from the parameters
    (y) and the state's z (the same ``mu_y`` as the transform's)."""
    mu_y = _in("mu_y", mu_y, 0.0, 1.0, closed_low=False)
    return jax.tree.map(lambda y, z: ((y - (1 - mu_y) * z) / mu_y).astype(y.dtype), params, state.z)


def check_inner_under_outer(inner: optax.GradientTransformation, outer, params: Any) -> None:
    """Refuses (``ValueError``, one line) GPA as the inner transform of an outer optimizer that
    moves the parameters (any outer with a transfer in its schedule: DiLoCo, Local SGD, ...).

    GPA's state keeps its own iterate ``z`` (AdamW steps ``z``; the parameters are ``y``, a
    mix of ``z`` and the average ``x``). An outer step sets ``y`` and leaves ``z`` where the
    replica's steps took it, so the next inner step pulls ``y`` back towards ``z``: another
    algorithm than either paper's, with no error. Data parallelism (``co2jax.data_parallel``
    with ``co2jax.no_sync()``, an empty schedule) keeps them consistent. The experiments'
    ``inner.optimizer=gpa`` is refused in the same case.

    Example:
      >>> import jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.diloco(optax.sgd(0.7))
      >>> check_inner_under_outer(co2jax.gpa(1e-3), outer, jnp.zeros(2))
      Traceback (most recent call last):
      ...
      ValueError: inner=co2jax.gpa(...): GPA keeps its own iterate z in its state, ...
      >>> check_inner_under_outer(co2jax.gpa(1e-3), co2jax.no_sync(), jnp.zeros(2))  # DDP
    """
    if not outer.schedule:
        return
    is_gpa = lambda node: isinstance(node, GPAState)
    state = jax.eval_shape(inner.init, params)
    if any(is_gpa(node) for node in jax.tree.leaves(state, is_leaf=is_gpa)):
        raise ValueError(
            "inner=co2jax.gpa(...): GPA keeps its own iterate z in its state, which an outer "
            "step that moves the parameters leaves behind: run GPA data parallel "
            "(co2jax.data_parallel(co2jax.gpa(...)) with co2jax.no_sync())"
        )
