"""scan_segments: a scan cut at event steps, equal to one scan plus the events in between."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from co2jax.engines.segments import Event, scan_segments


def _step(c, x):
    return c * 0.9 + x, c


def test_no_events_is_one_scan():
    xs = jnp.arange(7.0)
    want = jax.lax.scan(_step, jnp.float32(1.0), xs)
    got = scan_segments(_step, jnp.float32(1.0), xs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _issue(c, store):
    store["v"] = c * 2.0
    return c


def _consume(c, store):
    return c - store.pop("v") / 4.0


@pytest.mark.parametrize("issue_at, consume_at", [(0, 7), (2, 5), (3, 3), (7, 7), (0, 0)])
def test_events_match_a_python_loop(issue_at, consume_at):
    xs = np.arange(7.0, dtype=np.float32)
    events = [Event(issue_at, _issue), Event(consume_at, _consume)]
    carry, ys = scan_segments(_step, jnp.float32(1.0), jnp.asarray(xs), events)

    c, out, value = np.float32(1.0), [], None
    for t in range(len(xs) + 1):
        if t == issue_at:
            value = c * np.float32(2.0)
        if t == consume_at:
            c = c - value / np.float32(4.0)
        if t < len(xs):
            out.append(c)
            c = c * np.float32(0.9) + xs[t]
    np.testing.assert_allclose(carry, c, rtol=1e-6)
    np.testing.assert_allclose(ys, out, rtol=1e-6)


def test_pytree_carry_and_xs():
    xs = {"a": jnp.ones((4, 2)), "b": jnp.arange(4.0)}

    def step(c, x):
        return {"s": c["s"] + x["a"].sum() + x["b"]}, c["s"]

    def snap(c, store):
        store["k"] = c["s"]
        return c

    events = [Event(1, snap), Event(4, lambda c, store: {"s": c["s"] * store.pop("k")})]
    carry, ys = scan_segments(step, {"s": jnp.float32(0)}, xs, events)
    # s: 0 -> 2 -> 5 -> 9 -> 14, snapshot after step 0 is 2: 14 * 2
    assert float(carry["s"]) == 28.0
    assert ys.tolist() == [0.0, 2.0, 5.0, 9.0]


@pytest.mark.parametrize(
    "events, match",
    [
        ([Event(8, _issue)], "0 <= at <= 7"),
        ([Event(-1, _issue)], "0 <= at <= 7"),
        ([Event(True, _issue)], "0 <= at <= 7"),
        (["not an event"], "Event"),
    ],
)
def test_bad_events(events, match):
    with pytest.raises(ValueError, match=match):
        scan_segments(_step, jnp.float32(0), jnp.arange(7.0), events)


def test_program_size_does_not_grow_with_steps():
    """Segments, not steps, set the program: the jaxpr is the same size for 10 and 1000."""
    events = [Event(0, _issue), Event(5, lambda c, store: c + store.pop("v"))]

    def size(n):
        fn = lambda c, xs: scan_segments(_step, c, xs, events)
        return len(jax.make_jaxpr(fn)(jnp.float32(0), jnp.arange(float(n))).jaxpr.eqns)

    assert size(10) == size(1000)
