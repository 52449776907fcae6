"""Steps CoCoDC (reconstructed) needs to reach Streaming DiLoCo's final loss, on the textbook
quadratic.

    python benchmarks/cocodc_vs_streaming.py [--taus 1 2] [--seeds 5] [--rounds 30]

Replica r minimises ``mean_k 0.5 * sum(d_r * (theta - c_{r,k})**2)`` (the tests' textbook
problem, with curvatures spread over two decades so that it takes some rounds); R replicas
run plain SGD inside :func:`co2jax.local_updates` under ``jax.vmap``. The loss is the global
objective ``mean_r f_r`` at the replicas' average, minus its minimum, after every inner
step. For each tau: Streaming DiLoCo's loss after ``rounds * H`` steps is the target (the
step where it first got there is printed too); for CoCoDC (zeroth and first) the first step
at or below the target, searched up to twice that budget. Every method also runs to
``floor_rounds * H`` steps, and its loss there (its floor) is printed. Not a test: nothing
is asserted. Prints a row per tau: medians over seeds, and how many seeds reached the
target. The numbers are in docs/algorithms/cocodc.md.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import co2jax


def make_problem(seed: int, replicas: int, dim: int, examples: int = 2):
    rng = np.random.default_rng(seed)
    d = np.exp(rng.uniform(np.log(0.01), np.log(1.0), size=(replicas, dim)))
    c = rng.normal(size=(replicas, examples, dim))
    theta0 = rng.normal(size=dim) * 3.0
    return d, c.mean(axis=1), theta0


def excess_loss(d, c_bar):
    """``theta -> mean_r 0.5 * sum(d_r * (theta - c_r)**2) - min`` (constants dropped)."""
    best = (d * c_bar).sum(0) / d.sum(0)
    floor = np.mean(0.5 * np.sum(d * (best - c_bar) ** 2, axis=-1))
    d, c_bar = jnp.asarray(d, jnp.float32), jnp.asarray(c_bar, jnp.float32)
    return lambda theta: jnp.mean(0.5 * jnp.sum(d * (theta - c_bar) ** 2, axis=-1)) - floor


def trajectory(outer, problem, lr, H, steps):
    """Excess loss at the replicas' average after each of ``steps`` inner steps."""
    d, c_bar, theta0 = problem
    loss = excess_loss(d, c_bar)
    tx = co2jax.local_updates(optax.sgd(lr), outer, H)
    R = d.shape[0]
    params = {"theta": jnp.broadcast_to(jnp.asarray(theta0, jnp.float32), (R, theta0.size))}
    state = jax.vmap(tx.init)(params)
    dj, cj = jnp.asarray(d, jnp.float32), jnp.asarray(c_bar, jnp.float32)

    def replica_step(p, s, d_r, c_r):
        grads = {"theta": d_r * (p["theta"] - c_r)}
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.vmap(replica_step, axis_name="replica")

    @jax.jit
    def run(params, state):
        def body(carry, _):
            p, s = step(*carry, dj, cj)
            return (p, s), loss(p["theta"].mean(0))

        return jax.lax.scan(body, (params, state), None, length=steps)[1]

    return np.asarray(run(params, state), np.float64)


def first_at_or_below(curve, target):
    hit = np.nonzero(curve <= target)[0]
    return int(hit[0]) + 1 if hit.size else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30, help="Streaming DiLoCo's budget")
    parser.add_argument("--floor-rounds", type=int, default=500, help="the long run")
    parser.add_argument("--H", type=int, default=8, help="inner steps per round")
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1, help="inner SGD learning rate")
    parser.add_argument("--alpha", type=float, default=0.5, help="merge weight (both)")
    parser.add_argument("--hessian-scale", type=float, default=0.5)
    args = parser.parse_args()

    steps, long = args.rounds * args.H, args.floor_rounds * args.H
    shapes = {"theta": jax.ShapeDtypeStruct((args.dim,), jnp.float32)}
    frags = co2jax.fragments.make_fragments(shapes, args.fragments, stacked="theta")
    nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
    print(
        f"R={args.replicas} dim={args.dim} H={args.H} P={args.fragments} lr={args.lr} "
        f"alpha={args.alpha} outer Nesterov(0.7, 0.9) hessian_scale={args.hessian_scale}; "
        f"target: Streaming DiLoCo's loss after {steps} steps; CoCoDC searched up to "
        f"{2 * steps}; floor: loss after {long} steps; medians over {args.seeds} seeds"
    )
    print(
        f"{'tau':>3} {'target':>9} {'streaming':>9} {'zeroth':>6} {'reached':>7} "
        f"{'first':>6} {'reached':>7}   floor: {'streaming':>9} {'zeroth':>9} {'first':>9}"
    )
    for tau in args.taus:
        outers = {
            "streaming": co2jax.streaming_diloco(nesterov, frags, args.H, tau, args.alpha),
            **{
                c: co2jax.cocodc(nesterov, frags, args.H, tau, args.alpha, c, args.hessian_scale)
                for c in ("zeroth", "first")
            },
        }
        hits = {name: [] for name in outers}
        floors = {name: [] for name in outers}
        targets = []
        for seed in range(args.seeds):
            problem = make_problem(seed, args.replicas, args.dim)
            curves = {n: trajectory(o, problem, args.lr, args.H, long) for n, o in outers.items()}
            target = curves["streaming"][steps - 1]
            targets.append(target)
            for name, curve in curves.items():
                hits[name].append(first_at_or_below(curve[: 2 * steps], target))
                floors[name].append(curve[-1])
        cells = [f"{tau:>3}", f"{statistics.median(targets):>9.3e}"]
        for name, width in (("streaming", 9), ("zeroth", 6), ("first", 6)):
            reached = [v for v in hits[name] if v is not None]
            cells.append(f"{statistics.median(reached) if reached else float('nan'):>{width}.0f}")
            if name != "streaming":
                cells.append(f"{len(reached):>3}/{args.seeds:<3}")
        cells.append("  ")
        cells += [f"{statistics.median(floors[n]):>9.3e}" for n in outers]
        print(" ".join(cells))


if __name__ == "__main__":
    main()
