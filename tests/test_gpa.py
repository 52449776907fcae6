"""GPA (co2jax.gpa): a numpy port of the released rule (facebookresearch/optimizers,
gpa/gpa_adamw.py at 44aaa9f), the three explicit sequences, AdamW at mu_x = 0, frozen y at
mu_x = mu_y = 1, and bad settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import co2jax

STEPS = 25
A = np.array([[2.0, 0.3, 0.0], [0.3, 1.0, -0.2], [0.0, -0.2, 0.5]])
B = np.array([1.0, -2.0, 0.5])


def _grad(w):
    """Gradient of 0.5 w^T A w - b^T w (a quadratic with a known minimum)."""
    return A @ w - B


def _run(tx, steps=STEPS, w0=(1.0, 1.0, -1.0)):
    """The transform's y after each step, and its final state."""
    params = {"w": jnp.asarray(w0, jnp.float32)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = {"w": jnp.asarray(A, jnp.float32) @ params["w"] - jnp.asarray(B, jnp.float32)}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ys = []
    for _ in range(steps):
        params, state = step(params, state)
        ys.append(np.asarray(params["w"], np.float64))
    return np.stack(ys), params, state


def _released(lr, mu_y, mu_x, b1, b2, eps, wd, steps=STEPS, w0=(1.0, 1.0, -1.0)):
    """A numpy port of the released step (in-place form, weight decay added to the
    normalized gradient at y): lerp, addcmul and the y/z updates in the code's order."""
    y = np.asarray(w0, np.float64)
    z, m, v, c, ys = y.copy(), np.zeros(3), np.zeros(3), 1 - mu_x, []
    for k in range(1, steps + 1):
        g = _grad(y)
        m = m + (1 - b1) * (g - m)  # exp_avg.lerp_(grad, 1 - beta1)
        v = v * b2 + (1 - b2) * g * g
        denom = np.sqrt(v / (1 - b2**k)) + eps
        u = m / (1 - b1**k) / denom
        if wd:
            u = u + wd * y
        y = y + c * (z - y)  # y.lerp_(end=z, weight=avg_coeff)
        y = y + lr * (mu_y * (1 - c) - 1) * u
        z = z - lr * u
        ys.append(y.copy())
    return np.stack(ys), z


def _explicit(lr, mu_y, mu_x, b1, b2, eps, wd, form, steps=STEPS, w0=(1.0, 1.0, -1.0)):
    """The three sequences as the paper writes them: y from x and z, z AdamW's step, x the
    average; ``form`` says where the weight decay goes."""
    x = np.asarray(w0, np.float64)
    z, m, v, ys, xs = x.copy(), np.zeros(3), np.zeros(3), [], []
    for k in range(1, steps + 1):
        y = mu_y * x + (1 - mu_y) * z
        g = _grad(y)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
        if form == "gradient":
            u = u + wd * y
        z = z - lr * u
        x = mu_x * x + (1 - mu_x) * z
        ys.append(mu_y * x + (1 - mu_y) * z)
        xs.append(x)
    return np.stack(ys), np.stack(xs)


HYPER = dict(b1=0.9, b2=0.99, eps=1e-8)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_gpa_is_the_released_rule(wd):
    got, _, state = _run(co2jax.gpa(0.05, mu_y=0.7, mu_x=0.9, weight_decay=wd,
                                    weight_decay_form="gradient", **HYPER))  # fmt: skip
    want, z = _released(0.05, 0.7, 0.9, 0.9, 0.99, 1e-8, wd)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(state.z["w"]), z, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("form, wd", [("gradient", 0.05), ("z", 0.0)])
def test_the_in_place_update_is_the_three_sequences(form, wd):
    """y in place equals mu_y x + (1 - mu_y) z of the explicit sequences, and
    gpa_eval_params gives x (the decoupled form is compared without decay: with it, the
    in-place rule decays z where the explicit sequences have no counterpart)."""
    tx = co2jax.gpa(0.05, mu_y=0.6, mu_x=0.95, weight_decay=wd, weight_decay_form=form, **HYPER)
    got, params, state = _run(tx)
    want_y, want_x = _explicit(0.05, 0.6, 0.95, 0.9, 0.99, 1e-8, wd, form)
    np.testing.assert_allclose(got, want_y, rtol=2e-5, atol=2e-6)
    x = co2jax.gpa_eval_params(params, state, mu_y=0.6)["w"]
    np.testing.assert_allclose(np.asarray(x), want_x[-1], rtol=2e-5, atol=2e-6)
    assert np.abs(want_x[-1] - want_y[-1]).max() > 1e-3  # x and y do differ


@pytest.mark.parametrize("form", ["gradient", "z"])
@pytest.mark.parametrize("mu_y", [0.3, 1.0])
def test_no_averaging_is_adamw(form, mu_y):
    """mu_x = 0: x = y = z, GPA is AdamW (decoupled weight decay) for any mu_y."""
    got, _, _ = _run(co2jax.gpa(0.05, mu_y=mu_y, mu_x=0.0, weight_decay=0.1,
                                weight_decay_form=form, **HYPER))  # fmt: skip
    want, _, _ = _run(optax.adamw(0.05, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_full_averaging_freezes_y_and_a_schedule_counts_steps():
    got, _, state = _run(co2jax.gpa(0.05, mu_y=1.0, mu_x=1.0, **HYPER), steps=5)
    np.testing.assert_array_equal(got, np.tile([1.0, 1.0, -1.0], (5, 1)))
    assert np.abs(np.asarray(state.z["w"]) - [1.0, 1.0, -1.0]).max() > 0.1  # z moves
    warm = optax.linear_schedule(0.0, 0.05, 10)
    got, _, _ = _run(co2jax.gpa(warm, mu_y=0.7, mu_x=0.9, **HYPER), steps=1)
    np.testing.assert_array_equal(got[0], [1.0, 1.0, -1.0])  # step 0 has lr 0


def test_gpa_reaches_the_minimum():
    lr = optax.cosine_decay_schedule(0.05, 400)
    got, params, state = _run(co2jax.gpa(lr, mu_y=0.7, mu_x=0.9, **HYPER), steps=400)
    np.testing.assert_allclose(got[-1], np.linalg.solve(A, B), atol=1e-2)
    x = co2jax.gpa_eval_params(params, state, mu_y=0.7)["w"]
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(A, B), atol=1e-2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mu_y=0.0), r"^mu_y must be in \(0.0, 1.0\], got mu_y=0.0$"),
        (dict(mu_x=1.5), r"^mu_x must be in \[0.0, 1.0\], got mu_x=1.5$"),
        (dict(weight_decay_form="x"), "weight_decay_form"),
        (dict(learning_rate=0.0), "learning_rate must be > 0"),
        (dict(b1=1.0), "b1 and b2 must be < 1"),
        (dict(weight_decay=-1.0), "eps and weight_decay must be >= 0"),
    ],
)
def test_bad_settings_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.gpa(**kwargs)


def test_update_needs_the_parameters():
    tx = co2jax.gpa(0.1)
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="gpa needs the parameters"):
        tx.update(params, tx.init(params))
