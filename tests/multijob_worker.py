"""One replica job of ``test_multijob.py``; not a test itself.

Usage: ``python multijob_worker.py RANK ADDRESSES OUT_DIR [MODE]`` with ADDRESSES
comma-separated ``host:port`` of every job's transfer server (each job uses its port and the
``len(algorithms()) - 1`` after it, one per algorithm). Runs ROUNDS rounds of every algorithm
of the registry but DDP (which communicates every step, not per round) with
:class:`co2jax.JobTrainer` on the textbook problem (this job's replica slice of the data), as
``harness.registered`` builds it, and saves every round's parameters as
``OUT_DIR/{name}_{RANK}.npy`` ([rounds, dim]). MODE ``die`` makes the job exit after its first
round (a peer dying mid-run); ``wait`` runs the first algorithm with a short timeout and
records a PeerError in ``OUT_DIR/error_{RANK}.txt``, saving the state it had before the
failed round.
"""

from __future__ import annotations

import os
import sys

REPLICAS, ROUNDS, DATA_DEVICES, DIM = 2, 2, 2, 16
LR = 0.1


def algorithms() -> tuple[str, ...]:
    """Every algorithm of the registry that communicates per round (not DDP), DiLoCo first
    (the one the failure modes run). Imported when called: the worker sets up JAX first."""
    from co2jax.algorithms import registry

    # gossip exchanges with a group only: the transfer service's exchange is an all-gather
    caps = registry.capabilities
    names = [n for n in registry.NAMES if not (caps(n).every_step or caps(n).gossip)]
    import textbook as tb

    names += [v for v, (base, _, _) in tb.VARIANTS.items() if base in names]
    return tuple(sorted(names, key=lambda n: n != "diloco"))


def problem():
    import textbook as tb

    return tb.make_problem(replicas=REPLICAS, examples=2, dim=DIM, seed=5)


def main(rank: str, addresses: str, out_dir: str, mode: str = "run", names: str = "") -> None:
    """Rank ``rank``'s job: in mode "run" it trains each of ``names`` (comma-separated;
    default every one of :func:`algorithms`) for ROUNDS rounds and saves its parameters;
    "wait" and "die" run the first algorithm only, waiting briefly for a missing peer or
    exiting after one round."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DATA_DEVICES}"
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import harness
    import jax.numpy as jnp
    import numpy as np
    import textbook as tb
    from test_engine import engine_loss, textbook_batch

    import co2jax

    rank = int(rank)
    timeout = 4.0 if mode == "wait" else 120.0
    H = tb.REGISTERED_H
    prob = problem()
    batch = {k: v[rank] for k, v in textbook_batch(prob, H).items()}
    mesh = co2jax.make_mesh(replica=1, data=DATA_DEVICES)
    names = names.split(",") if names else (algorithms()[:1] if mode != "run" else algorithms())
    for step, name in enumerate(names):
        # each algorithm gets its own ports: a transfer server lives as long as the process
        ports = [a.rpartition(":") for a in addresses.split(",")]
        peers = co2jax.Peers(
            tuple(f"{h}:{int(p) + step}" for h, _, p in ports), rank, timeout_s=timeout
        )
        outer, inner = harness.registered(name, prob, LR, H)
        trainer = co2jax.JobTrainer(engine_loss, inner, outer, peers, H, mesh)
        state = trainer.init(harness.unflatten(jnp.asarray(prob.theta0, jnp.float32)))
        out = []
        for r in range(ROUNDS):
            if mode == "die" and r == 1:
                os._exit(3)
            try:
                state, _ = trainer.round(state, batch)
            except co2jax.PeerError as e:
                with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
                    f.write(str(e))
                # the state of the last completed round is intact and readable
                np.save(
                    os.path.join(out_dir, f"kept_{rank}.npy"),
                    np.asarray(harness.flatten(state.params))[0],
                )
                os._exit(0)
            out.append(np.asarray(harness.flatten(state.params))[0])
        np.save(os.path.join(out_dir, f"{name}_{rank}.npy"), np.stack(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
