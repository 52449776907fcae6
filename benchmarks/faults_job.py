"""One replica job of the fault testbed (``benchmarks/faults.py`` starts and kills them).

    python -m benchmarks.faults_job --rank 0 --peers 127.0.0.1:7300,... --mode tolerant \\
        --rounds 30 --progress results/faults/kill_0.jsonl

Trains the cpu-tiny transformer under :class:`co2jax.JobTrainer` (DiLoCo, the testbed's
model and data, this replica's stream) and appends one JSON line per round to
``--progress``: its wall-clock start and end, steps, participants, loss. Modes:

- ``tolerant``: ``Peers(quorum=R-1)``; ``--rejoin`` starts by :meth:`JobTrainer.rejoin`,
  and a round that fails with :class:`co2jax.PeerError` (this job out of step) is followed
  by a rejoin too;
- ``strict``: every replica in every exchange (a dead peer fails the round); a checkpoint
  after every round (``--ckpt``), and ``--restore-round N`` starts from round N's: the
  baseline's global restart;
- ``dylu``: strict, with ``dylu=True``.

``--pad-s S`` pads every round's inner steps to at least S seconds (a sleep after the
round, standing for compute a bigger model would take; ``benchmarks/goodput.py``), and
``--cache-dir D`` turns on JAX's persistent compilation cache there (a job's mesh is one
device: safe, ``co2jax.compilation_cache``), so a restarted job loads its programs instead
of compiling them. The last line of ``--progress`` is ``{"final": ...}``: the fingerprint
of the anchor the job ends with (``co2jax.fingerprint``).

``--slow F`` makes this job F times slower: after its inner steps it sleeps (F - 1) times
their duration, and it reports F times its measured time per step to DyLU (the previous
round's, as DyLU uses).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SECRET = "fault testbed run secret"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--mode", choices=("tolerant", "strict", "dylu"), required=True)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--slow", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace-s", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--rejoin", action="store_true")
    parser.add_argument("--late", choices=("drop", "carry"), default="drop")
    parser.add_argument("--ckpt", default=None, help="strict: a checkpoint folder per round")
    parser.add_argument("--restore-round", type=int, default=None, help="strict: restart here")
    parser.add_argument("--progress", required=True)
    parser.add_argument("--pad-s", type=float, default=0.0, help="each round at least this")
    parser.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    import co2jax
    from benchmarks.slowlink_job import build

    addresses = tuple(args.peers.split(","))
    R = len(addresses)
    quorum = R - 1 if args.mode == "tolerant" else None
    peers = co2jax.Peers(
        addresses, args.rank, args.timeout_s, quorum=quorum, grace_s=args.grace_s, secret=SECRET
    )
    loss_fn, inner, outer, params, streams, H = build(peers, "diloco", args.sync_every, args.seed)
    late = args.late if args.mode == "tolerant" else "drop"
    trainer = co2jax.JobTrainer(
        loss_fn, inner, outer, peers, H, dylu=args.mode == "dylu", min_steps=2, late=late
    )
    ckpt = Path(args.ckpt) if args.ckpt else None
    if args.rejoin:
        state = trainer.rejoin(params)
    elif args.restore_round:
        state = trainer.restore(str(ckpt / f"round_{args.restore_round}_{args.rank}"), params)
    else:
        state = trainer.init(params)
    log = open(args.progress, "a")
    step_time = None
    while state.round < args.rounds:
        k = int(state.round)
        began = time.time()
        batch = streams.round_batch(k)[args.rank]
        try:
            state, m = trainer.round(state, batch, step_time=step_time)
        except co2jax.PeerError as e:
            if args.mode != "tolerant":
                raise
            # out of step with the others (a payload it needed died with its sender): back
            # in through a live peer, as a restarted job
            print(f"replica {args.rank}: {e}; rejoining", flush=True)
            state = trainer.rejoin(params)
            continue
        if args.slow > 1:  # slower hardware: the steps take F times as long
            time.sleep((args.slow - 1) * m.compute_s)
        if args.pad_s > m.compute_s:  # a bigger model's compute (the wait is not padded)
            time.sleep(args.pad_s - m.compute_s)
        step_time = args.slow * m.compute_s / m.steps
        if ckpt is not None:
            trainer.save(str(ckpt / f"round_{k + 1}_{args.rank}"), state)
        row = {
            "round": k,
            "start": began,
            "end": time.time(),
            "steps": m.steps,
            "compute_s": m.compute_s,
            "wait_s": m.wait_s,
            "participants": [list(p) for p in m.participants],
            "carried": [list(c) for c in m.carried],
            "admitted": list(m.admitted),
            "loss": float(np.mean(m.losses)),
            "tokens_per_step": int(np.prod(batch.shape[1:])),
        }
        log.write(json.dumps(row) + "\n")
        log.flush()
    log.write(json.dumps({"final": int(co2jax.fingerprint(state.params))}) + "\n")
    log.flush()
    time.sleep(3.0)  # the last payloads stay offered while slower peers pull them
    os._exit(0)


if __name__ == "__main__":
    main()
