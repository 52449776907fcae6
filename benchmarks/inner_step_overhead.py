"""Time per inner step: the round engine and the per-step adapter against plain data parallel.

Three programs train the same residual-MLP model (``_common.loss_fn``) with the same inner
AdamW on the same ``[replica, H, batch, d_model]`` batch, over the same ``(replica, data)``
mesh, each as ONE jitted call per H inner steps (so Python dispatch is comparable):

- baseline, data parallel: a plain optax step in ``jax.shard_map``, gradients ``pmean``'d over
  both ``replica`` and ``data`` every step, H steps in a ``lax.scan``;
- ``RoundTrainer.round`` (public API, host-side checks included): H inner steps (gradients
  averaged over ``data``) plus the outer sync, for CO2 and DiLoCo;
- the per-step adapter ``co2jax.local_updates`` in a ``lax.scan`` of H steps inside
  ``shard_map`` (the sync runs in a ``lax.cond`` on the H-th step);
- with ``--spread``: CO2's round with its delayed payload in a chunk per inner step
  (``spread=H``, the TPU default) against the same round unspread, both with the
  ``all_gather`` reducer; and Streaming DiLoCo (2 fragments, tau = 2) against DiLoCo's round
  (targets: <= 1.05x and <= 1.1x).

Each call is timed (blocked on) after two warm-up calls that include compilation; calls of
the programs are interleaved round-robin and the median over ``--reps`` is reported, with the
ratio of ms per inner step to the baseline's (and the same for the fastest call, which is
less sensitive to other load on a shared host). The target for the round engine is <= 1.02x.

On CPU the mesh is 8 emulated devices sharing the host's cores, and XLA:CPU runs collectives
synchronously (nothing overlaps), so the ratios measure per-step overhead of the engine's
program (plus a per-round sync), not communication hiding.

    JAX_PLATFORMS=cpu python benchmarks/inner_step_overhead.py [--sync-every 8] [--reps 5]
    JAX_PLATFORMS=cpu python benchmarks/inner_step_overhead.py --spread
"""

from __future__ import annotations

import argparse
import time

import _common as C
import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import DATA, REPLICA

BATCH_SPEC = P(REPLICA, None, DATA)


def _step(tx, axes):
    """One inner step: this shard's gradient, mean over ``axes``, then the optax update."""

    def step(carry, b):
        p, s = carry
        pv = jax.lax.pcast(p, axes, to="varying")
        loss, grads = jax.value_and_grad(C.loss_fn)(pv, b)
        grads = jax.lax.pmean(grads, axes)
        updates, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, updates), s), jax.lax.pmean(loss, axes)

    return step


def data_parallel_program(mesh, tx):
    """Plain data parallel: replicated params, gradients averaged over every device."""
    axes = (REPLICA, DATA)

    def body(params, opt_state, batch):
        batch = jax.tree.map(lambda x: x[0], batch)  # [H, B_local, ...]
        (params, opt_state), losses = jax.lax.scan(_step(tx, axes), (params, opt_state), batch)
        return params, opt_state, losses

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), BATCH_SPEC), out_specs=(P(), P(), P()))
    return jax.jit(fn, donate_argnums=(0, 1))


def adapter_program(mesh, tx):
    """``local_updates`` stepped H times in a scan; per-replica state on a leading axis."""

    def body(params, opt_state, batch):
        params, opt_state, batch = jax.tree.map(lambda x: x[0], (params, opt_state, batch))
        (params, opt_state), losses = jax.lax.scan(_step(tx, DATA), (params, opt_state), batch)
        return jax.tree.map(lambda x: x[None], (params, opt_state, losses))

    rep = P(REPLICA)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(rep, rep, BATCH_SPEC), out_specs=(rep,) * 3)
    return jax.jit(fn, donate_argnums=(0, 1))


def main(args) -> None:
    devices = jax.devices()[: args.replica * args.data]
    mesh = co2jax.make_mesh(replica=args.replica, data=args.data, devices=devices)
    R, H = args.replica, args.sync_every
    params0 = C.init_params(jax.random.key(0), args.d_model, args.d_ff, args.layers)
    nparams = C.num_params(params0)
    per_device = args.batch // args.data
    print(
        f"{jax.device_count()} {devices[0].platform} devices, mesh replica={R} x data="
        f"{args.data}; model {nparams / 1e6:.2f}M params ({C.fmt_bytes(4 * nparams)} f32), "
        f"H={H}, batch {args.batch}/replica/step ({per_device}/device), reps={args.reps}"
    )
    batch = C.make_batch(jax.random.key(1), R, H, args.batch, args.d_model)
    placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, BATCH_SPEC)), batch)
    inner = C.inner_optimizer()

    runs = {}  # name -> callable advancing its own state by one call (H inner steps)

    # (b) baseline: data parallel over every device
    dp = data_parallel_program(mesh, inner)
    replicated = NamedSharding(mesh, P())
    dp_state = [
        jax.device_put(params0, replicated),
        jax.device_put(inner.init(params0), replicated),
    ]

    def run_dp():
        dp_state[0], dp_state[1], losses = dp(dp_state[0], dp_state[1], placed)
        return losses

    runs["data parallel (baseline)"] = run_dp

    for name, make_outer in C.outer_algorithms().items():
        # (a) the round engine, through its public API
        trainer = co2jax.RoundTrainer(C.loss_fn, inner, make_outer(), mesh, sync_every=H)
        holder = [trainer.init(params0)]

        def run_round(trainer=trainer, holder=holder):
            holder[0], metrics = trainer.round(holder[0], batch)
            return metrics.loss

        runs[f"RoundTrainer.round {name}"] = run_round

        # (c) the per-step adapter in a scan of H steps
        tx = co2jax.local_updates(inner, make_outer(), sync_every=H)
        stacked = jax.tree.map(lambda x: jax.numpy.broadcast_to(x, (R, *x.shape)), params0)
        rep = NamedSharding(mesh, P(REPLICA))
        state = [jax.device_put(stacked, rep), jax.device_put(jax.vmap(tx.init)(stacked), rep)]
        program = adapter_program(mesh, tx)

        def run_adapter(program=program, state=state):
            state[0], state[1], losses = program(state[0], state[1], placed)
            return losses

        runs[f"local_updates scan {name}"] = run_adapter

    if args.spread:
        co2 = C.outer_algorithms()["co2"]
        for label, spread in [("unspread", False), ("spread", H)]:
            trainer = co2jax.RoundTrainer(
                C.loss_fn, inner, co2(), mesh, H, reducer="all_gather", spread=spread
            )
            held = [trainer.init(params0)]
            runs[f"round co2 all_gather {label}"] = lambda t=trainer, h=held: _advance(t, h, batch)
        frags = co2jax.fragments.make_fragments(params0, 2, stacked="scale|w1|b1|w2")
        nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
        trainer = co2jax.RoundTrainer(
            C.loss_fn, inner, co2jax.streaming_diloco(nesterov, frags, H, tau=2), mesh, H
        )
        held = [trainer.init(params0)]
        runs["round streaming_diloco tau=2"] = lambda t=trainer, h=held: _advance(t, h, batch)

    # warm up (compile + one more call), then time round-robin
    for name, run in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(run())
        first = time.perf_counter() - start
        jax.block_until_ready(run())
        print(f"  warm-up {name:<30} first call {first:6.2f} s", flush=True)
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)

    # host-side cost of round() beyond the compiled program: argument checks + placement
    trainer_state = holder[0]
    check = C.time_calls(
        lambda: (trainer.check_batch(trainer_state, batch), trainer.place_batch(batch))[1],
        reps=args.reps,
    )

    base = C.median(times["data parallel (baseline)"]) / H
    base_min = min(times["data parallel (baseline)"]) / H
    print(
        f"\n{'program':<32} {'ms/call':>8} {'ms/inner step':>14} {'vs baseline':>12} "
        f"{'min ms/step':>12} {'min vs min':>11}"
    )
    for name, ts in times.items():
        per_step, fastest = C.median(ts) / H, min(ts) / H
        print(
            f"{name:<32} {1e3 * C.median(ts):>8.1f} {1e3 * per_step:>14.2f} "
            f"{per_step / base:>11.3f}x {1e3 * fastest:>12.2f} {fastest / base_min:>10.3f}x"
        )
        if args.raw:
            print(f"    calls (ms): {[round(1e3 * t) for t in ts]}")
    spread = {n: (max(ts) - min(ts)) / C.median(ts) for n, ts in times.items()}
    print(
        f"\nmedian (and min) of {args.reps} interleaved calls each; max-min spread up to "
        f"{100 * max(spread.values()):.0f}% of the median. round() host-side checks and batch "
        f"placement: {1e3 * C.median(check):.2f} ms per call (included above)."
    )
    if jax.default_backend() == "cpu":
        print(
            "XLA:CPU runs collectives synchronously and the emulated devices share the host's "
            "cores: these ratios are per-step program overhead, not communication hiding."
        )
    else:
        print(f"measured on {jax.devices()[0].device_kind} ({jax.device_count()} devices)")


def _advance(trainer, held, batch):
    held[0], metrics = trainer.round(held[0], batch)
    return metrics.loss


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, default=2)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=8, help="H, inner steps per call")
    parser.add_argument("--batch", type=int, default=128, help="examples per replica and step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--raw", action="store_true", help="print every call's time")
    parser.add_argument(
        "--spread", action="store_true", help="also time spread and Streaming DiLoCo rounds"
    )
    return C.check_mesh_args(parser, parser.parse_args())


if __name__ == "__main__":
    main(_parse_args())
