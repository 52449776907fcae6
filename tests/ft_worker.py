"""One job of ``test_fault_tolerance.py``; not a test itself.

Usage: ``python ft_worker.py RANK ADDRESSES OUT_DIR MODE``. Every job runs DiLoCo (the
registry's textbook configuration) on its replica's slice of the textbook problem with
``Peers(quorum=2, grace_s=GRACE_S)`` and ``drift_every=1``, and writes what it saw to
``OUT_DIR/{MODE}_{RANK}.json``: per completed round its parameters, participants, who was
left out and why, admissions. Modes:

- ``survive``: rounds until 3 rounds after one where a job was admitted (at most
  MAX_ROUNDS), ``ROUND_SLEEP_S`` apart so that a restarted job has time to come back;
- ``die``: exits abruptly (``os._exit``) before its round DIE_AT;
- ``die_deciding``: the coordinator's death at its worst moment: in round DIE_AT, after
  its payload went out, just before it sends its decision;
- ``rejoin_die_deciding``: ``rejoin``, then ``die_deciding`` in its second round;
- ``outlive``: DIE_AT + 3 rounds, no fault of its own;
- ``rejoin``: :meth:`JobTrainer.rejoin`, then 3 rounds;
- ``nan``: its batch of round POISON_AT is NaN (a non-finite payload);
- ``malformed``: its payload header of round POISON_AT is corrupted;
- ``steady``: POISON_AT + 2 rounds, no fault;
- ``poisoned``, ``healthy``: inner heavy-ball SGD (a state a NaN poisons), POISON_AT + 3
  rounds; ``poisoned``'s batch of round POISON_AT is NaN;
- ``carry``, ``carry_late``: ``steady`` with ``late="carry"``; ``carry_late`` starts its
  round POISON_AT late, so that its payload misses the grace window;
- ``robust``, ``robust_huge``: ``steady`` with ``robust=True``; ``robust_huge``'s round
  POISON_AT has targets 10^4 times too large (a faulty replica);
- ``drift``: as ``steady`` but rank 1 starts from other parameters; records the DriftError;
- ``keys``: two exchanges in this one process, one with another secret: writes whether a
  pull with the wrong key got anything within 2 s, and one with the right key.

Every exit is ``os._exit``: a pull that never completes must not hold the process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

REPLICAS, DATA_DEVICES, DIM = 3, 1, 16
LR, GRACE_S, ROUND_SLEEP_S, MAX_ROUNDS = 0.1, 0.3, 0.4, 60
DIE_AT, POISON_AT, LINGER_S = 2, 1, 3.0
MOMENTUM = 0.9
SECRET = "a per-run secret, 16+ chars"


def problem():
    import textbook as tb

    return tb.make_problem(replicas=REPLICAS, examples=2, dim=DIM, seed=5)


def _keys(addresses: list[str], out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import co2jax
    from co2jax.engines.exchange import Exchange, transfer_key

    peers = lambda rank, secret: co2jax.Peers(tuple(addresses[:2]), rank, secret=secret)
    a = Exchange(peers(0, SECRET))
    b = Exchange(peers(1, "another secret, 16+ chars"))
    x = jnp.arange(4.0)
    a.publish("payload", 0, [x], [1])  # offered to rank 1, named with the run's secret
    result = {"repr": repr(a.peers)}

    def pull() -> None:
        try:
            result["wrong"] = np.asarray(b.pull("payload", 0, 0, [x])[0]).tolist()
        except Exception as e:
            result["wrong"] = f"error: {e}"

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    t.join(2.0)
    result["wrong_pending_after_2s"] = t.is_alive()
    key = transfer_key(peers(1, SECRET), "payload", 0, 0, 1)  # the same, with the secret
    spec = jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(b.device)
    )
    result["right"] = np.asarray(b.server.connect(addresses[0]).pull(key, [spec])[0]).tolist()
    with open(os.path.join(out, "keys.json"), "w") as f:
        json.dump(result, f)


def main(rank: str, addresses: str, out: str, mode: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DATA_DEVICES}"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
    import jax.numpy as jnp
    import numpy as np
    import optax
    import textbook as tb
    from test_engine import engine_loss, textbook_batch

    import co2jax
    from co2jax.engines import jobstate

    rank, addresses = int(rank), addresses.split(",")
    if mode == "keys":
        _keys(addresses, out)
        os._exit(0)
    H = tb.REGISTERED_H
    prob = problem()
    batch = {k: v[rank] for k, v in textbook_batch(prob, H).items()}
    mesh = co2jax.make_mesh(replica=1, data=DATA_DEVICES)
    peers = co2jax.Peers(
        tuple(addresses), rank, timeout_s=60.0, quorum=2, grace_s=GRACE_S, secret=SECRET
    )
    outer, inner = harness.registered("diloco", prob, LR, H)
    if mode in ("poisoned", "healthy"):
        inner = optax.sgd(LR, momentum=MOMENTUM)
    robust = mode.startswith("robust")
    late = "carry" if mode.startswith("carry") else "drop"
    trainer = co2jax.JobTrainer(
        engine_loss, inner, outer, peers, H, mesh, drift_every=1, robust=robust, late=late
    )
    theta0 = jnp.asarray(prob.theta0, jnp.float32)
    if mode == "drift" and rank == 1:
        theta0 = theta0 + 1e-3  # another seed's initial parameters
    params = harness.unflatten(theta0)
    rejoins = mode in ("rejoin", "rejoin_die_deciding")
    state = trainer.rejoin(params) if rejoins else trainer.init(params)
    record = {"rounds": {}, "events": [], "error": None, "start_round": int(state.round)}
    stops = {"survive": MAX_ROUNDS, "die": DIE_AT, "outlive": DIE_AT + 3}
    stops["die_deciding"] = DIE_AT + 1
    stops.update(poisoned=POISON_AT + 3, healthy=POISON_AT + 3)
    stop = stops.get(mode, POISON_AT + 2)
    if rejoins:
        stop = state.round + 3
    real_frame = jobstate.frame
    if mode in ("die_deciding", "rejoin_die_deciding"):
        real_publish = trainer.exchange.publish
        dies_at = DIE_AT if mode == "die_deciding" else state.round + 1

        def publish(kind, step, leaves, dests):
            if kind == "decision" and state.round == dies_at:
                os._exit(3)
            real_publish(kind, step, leaves, dests)

        trainer.exchange.publish = publish
    while state.round < stop:
        if mode == "survive":
            time.sleep(ROUND_SLEEP_S)
        if mode.startswith("carry"):  # rounds slower than the lag below
            time.sleep(2 * ROUND_SLEEP_S)
        if mode == "carry_late" and state.round == POISON_AT:
            time.sleep(2 * GRACE_S)  # misses this round's grace window, not the next
        b = batch
        if mode in ("nan", "poisoned") and state.round == POISON_AT:
            b = {**batch, "d": batch["d"] * jnp.nan}
        if mode == "robust_huge" and state.round == POISON_AT:
            b = {**batch, "c": batch["c"] * 1e4}  # a faulty replica's enormous update
        if mode == "malformed":
            bad = state.round == POISON_AT

            def frame(leaves, r, step, weight, bad=bad):
                out = real_frame(leaves, r, step, weight)
                if bad:
                    out[0] = out[0] + np.uint32(1)  # a digest no job expects
                return out

            jobstate.frame = frame
        try:
            state, metrics = trainer.round(state, b)
        except co2jax.DriftError as e:
            record["error"] = {"drift": str(e), "replicas": list(e.replicas), "round": e.round}
            break
        record["rounds"][int(state.round) - 1] = {
            "params": np.asarray(harness.flatten(state.params))[0].astype(float).tolist(),
            "participants": [list(p) for p in metrics.participants],
            "left_out": [{str(k): v for k, v in d.items()} for d in metrics.left_out],
            "admitted": list(metrics.admitted),
            "carried": [list(c) for c in metrics.carried],
            "time": time.time(),
        }
        if mode == "survive" and metrics.admitted:
            stop = state.round + 3
    record["events"] = trainer.membership.events
    with open(os.path.join(out, f"{mode}_{rank}.json"), "w") as f:
        json.dump(record, f)
    time.sleep(LINGER_S)  # its last payloads stay offered while slower peers pull them
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
