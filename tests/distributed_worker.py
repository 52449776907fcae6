"""One process of the 2-process CPU run in ``test_distributed.py``; not a test itself.

Usage: ``python distributed_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR``. Joins the run
with 4 CPU devices, builds one (replica=4, data=2) mesh over all 8 devices, runs ROUNDS rounds
of each algorithm in ``ALGORITHMS`` with the round engine on the textbook problem, and saves
every round's parameters, gathered from all processes, as ``OUT_DIR/{name}_{PROCESS_ID}.npy``
([rounds, R, dim]). JAX is imported only in ``main``: the CPU device count must be set first.
"""

from __future__ import annotations

import os
import sys

LOCAL_DEVICES, REPLICAS, DATA, ROUNDS = 4, 4, 2, 2
# name -> whether the batch enters as one global jax.Array (built from each process's own
# slices, as a multi-host data loader does) rather than as the same host array everywhere
ALGORITHMS = {"diloco": False, "co2": True}


def _global_batch(batch, mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("replica", None, "data"))
    host = jax.tree.map(np.asarray, batch)
    # each process materializes only the slices its own devices hold
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), host
    )


def run(name: str, mesh, global_batch: bool):
    """[ROUNDS, R, dim] parameters of every replica after each round, on every process."""
    import harness
    import jax.numpy as jnp
    import numpy as np
    import optax
    import textbook as tb
    from jax.experimental import multihost_utils
    from test_algorithms import CASES
    from test_engine import LR, H, engine_loss, textbook_batch

    import co2jax

    outer = next(case for case in CASES if case.name == name).make()
    problem = tb.make_problem(replicas=REPLICAS, examples=2)
    trainer = co2jax.RoundTrainer(engine_loss, optax.sgd(LR), outer, mesh, sync_every=H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    batch = textbook_batch(problem)  # the same global [R, H, K, dim] batch on every process
    if global_batch:
        batch = _global_batch(batch, mesh)
    out = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, batch)
        # the params live on both processes' devices: gather them before reading on the host
        params = multihost_utils.process_allgather(state.params, tiled=True)
        out.append(np.concatenate([params["b"], params["w"]], axis=-1))
    assert (multihost_utils.process_allgather(state.round, tiled=True) == ROUNDS).all()
    return np.stack(out)


def main(port: str, process_id: str, num_processes: str, out_dir: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import co2jax.distributed

    info = co2jax.distributed.initialize(
        f"127.0.0.1:{port}",
        int(num_processes),
        int(process_id),
        local_device_count=LOCAL_DEVICES,
        initialization_timeout=60,
    )
    assert info.process_id == int(process_id), info
    assert info.global_devices == LOCAL_DEVICES * int(num_processes), info

    import numpy as np

    import co2jax

    mesh = co2jax.make_mesh(replica=REPLICAS, data=DATA)
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices[..., 0])
    # the replica axis spans the processes; each replica's data shards share one process
    assert (owner == np.arange(REPLICAS)[:, None] * int(num_processes) // REPLICAS).all(), owner
    for name, global_batch in ALGORITHMS.items():
        np.save(os.path.join(out_dir, f"{name}_{process_id}.npy"), run(name, mesh, global_batch))


if __name__ == "__main__":
    main(*sys.argv[1:])
