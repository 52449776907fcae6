"""Compile time of a RoundTrainer round with many inner steps against few (H=500 vs H=5).

The round runs its H inner steps as one ``lax.scan`` that is never unrolled, so the compiled
program, and the time to build it, should barely depend on H (target: H=500 / H=5 <= 1.2x).
Each measurement builds a fresh ``RoundTrainer`` (nothing cached between them), traces and
lowers the round for abstract inputs (``trainer.abstract_state`` and ``ShapeDtypeStruct``
batches; nothing is allocated), then compiles it for the emulated CPU mesh. The two H values
are measured alternately, ``--reps`` times each, and the medians are reported.

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py [--small-h 5] [--large-h 500] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import _common as C
import jax

import co2jax


def compile_once(make_outer, mesh, args, steps: int) -> tuple[float, float, str]:
    """(seconds to trace and lower, seconds to compile, compiled HLO text) for one H."""
    trainer = co2jax.RoundTrainer(
        C.loss_fn, C.inner_optimizer(), make_outer(), mesh, sync_every=steps
    )
    params = C.param_shapes(args.d_model, args.d_ff, args.layers)
    batch = C.abstract_batch(mesh, args.replica, steps, args.batch, args.d_model)
    start = time.perf_counter()
    lowered = trainer.lower(trainer.abstract_state(params), batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return lowered_at - start, done - lowered_at, compiled.as_text()


def main(args) -> None:
    jax.config.update("jax_enable_compilation_cache", False)  # no persistent cache hits
    devices = jax.devices()[: args.replica * args.data]
    mesh = co2jax.make_mesh(replica=args.replica, data=args.data, devices=devices)
    nparams = C.num_params(C.param_shapes(args.d_model, args.d_ff, args.layers))
    hs = (args.small_h, args.large_h)
    print(
        f"{len(devices)} {devices[0].platform} devices, mesh replica={args.replica} x data="
        f"{args.data}; model {nparams / 1e6:.2f}M params; H in {hs}; reps={args.reps}"
    )
    algorithms = C.outer_algorithms()
    names = list(algorithms) if args.algorithm == "all" else [args.algorithm]
    rows = []
    for name in names:
        lower = {h: [] for h in hs}
        comp = {h: [] for h in hs}
        sizes = {}
        compile_once(algorithms[name], mesh, args, args.small_h)  # warm JAX's own imports
        for _ in range(args.reps):
            for h in hs:
                t_lower, t_compile, text = compile_once(algorithms[name], mesh, args, h)
                lower[h].append(t_lower)
                comp[h].append(t_compile)
                sizes[h] = len(text)
            print(
                f"  {name}: "
                + ", ".join(f"H={h} {lower[h][-1]:.2f}+{comp[h][-1]:.2f} s" for h in hs),
                flush=True,
            )
        rows.append((name, lower, comp, sizes))

    small, large = hs
    print(
        f"\n{'outer':<8} {'H':>5} {'lower s':>8} {'compile s':>10} {'total s':>8} "
        f"{'HLO chars':>10} {'total vs H=' + str(small):>13}"
    )
    for name, lower, comp, sizes in rows:
        base = C.median([a + b for a, b in zip(lower[small], comp[small], strict=True)])
        for h in hs:
            total = C.median([a + b for a, b in zip(lower[h], comp[h], strict=True)])
            print(
                f"{name:<8} {h:>5} {C.median(lower[h]):>8.2f} {C.median(comp[h]):>10.2f} "
                f"{total:>8.2f} {sizes[h]:>10} {total / base:>12.3f}x"
            )
    print(f"\nmedians of {args.reps} fresh lower+compile runs each (target H={large} <= 1.2x).")


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, default=2)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--small-h", type=int, default=5)
    parser.add_argument("--large-h", type=int, default=500)
    parser.add_argument("--batch", type=int, default=256, help="examples per replica and step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--algorithm", choices=["all", *C.outer_algorithms()], default="all")
    parser.add_argument("--reps", type=int, default=3)
    return C.check_mesh_args(parser, parser.parse_args())


if __name__ == "__main__":
    main(_parse_args())
