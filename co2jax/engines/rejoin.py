"""A restarted job's way back in, and a job's checkpoints.

**Rejoin.** A job that died and was started again has lost its state. It greets every peer
(:func:`co2jax.engines.membership.greet`, with a fresh nonce). The coordinator admits it at a
round's end (:mod:`co2jax.engines.membership`) and hands it its own state after that round
(:func:`welcome`): parameters, inner optimizer state, outer state, the round and the exchange
count, under a key made from the nonce. The joiner (:func:`rejoin`) resets the outer state's
replica-varying fields (:func:`co2jax.engines.jobstate.reset_varying`: error-feedback
residuals and in-flight pseudo-gradients were the coordinator's own, and counting them twice
would be wrong). In its first round, the payloads it sends before any inner step (a delayed
algorithm's) weigh 0. From then on its anchor is the others' bit for bit.

**Checkpoints.** :func:`save` and :func:`restore` write and read a job's whole state with
orbax, plus its round, exchange count and membership, checked against the job's rank and
R on restore.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from co2jax.engines import jobstate
from co2jax.engines.exchange import PeerError
from co2jax.engines.jobstate import JobState
from co2jax.engines.membership import greet


def _one_replica(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _like(trainer, state) -> list:
    leaves = jax.tree.leaves((state.params, state.inner_state, state.outer_state))
    return [*leaves, np.zeros(2 + trainer.peers.replicas, np.int32)]


def welcome(trainer, state, admitted) -> None:
    """Hands ``state`` (after the round) to each admitted job."""
    mask = np.zeros(trainer.peers.replicas, np.int32)
    mask[list(state.members)] = 1
    meta = np.asarray([state.round, state.exchanges, *mask], np.int32)
    leaves = jax.tree.leaves((state.params, state.inner_state, state.outer_state))
    for rank in admitted:
        nonce = trainer.membership.nonce(rank)
        trainer.exchange.publish("welcome", nonce, [*leaves, meta], [rank])
        trainer.membership.note(f"round {state.round - 1}: handed its state to replica {rank}")


def rejoin(trainer, params: Any):
    """The state of a restarted job, handed over by a live peer: its parameters, inner
    state and outer state after the round it admits this job at (their replica-varying
    fields reset: :func:`co2jax.engines.jobstate.reset_varying`), the round and the
    exchange count. ``params``: the initial parameters (for the shapes). Raises
    :class:`~co2jax.engines.exchange.PeerError` when no peer admits it within
    ``timeout_s``. Needs a quorum below R (the others went on without this job)."""
    if not trainer.peers.tolerant:
        raise ValueError("rejoin needs Peers(quorum=...) below R: the others go on meanwhile")
    local = trainer.init(params)
    like = _like(trainer, local)
    nonce = greet(trainer.exchange)
    got: list = []
    failed: dict = {}
    arrived = threading.Event()

    def pull(peer: int) -> None:
        try:
            got.append(trainer.exchange.pull("welcome", nonce, peer, like))
            arrived.set()
        except Exception as e:  # a dead peer: another one admits this job
            failed[peer] = str(e)

    for peer in range(trainer.peers.replicas):
        if peer != trainer.peers.rank:
            threading.Thread(target=pull, args=(peer,), daemon=True).start()
    if not arrived.wait(trainer.peers.timeout_s):
        raise PeerError(
            f"replica {trainer.peers.rank}: no live peer admitted this job within "
            f"timeout_s={trainer.peers.timeout_s}"
            + "".join(f"; peer {r}: {why}" for r, why in sorted(failed.items()))
        )
    arrays, meta = got[0][:-1], np.asarray(got[0][-1])
    treedef = jax.tree.structure((local.params, local.inner_state, local.outer_state))
    refs = jax.tree.leaves((local.params, local.inner_state, local.outer_state))
    placed = [jax.device_put(x, ref.sharding) for x, ref in zip(arrays, refs, strict=True)]
    p, inner_state, outer_state = jax.tree.unflatten(treedef, placed)
    fresh = jax.jit(trainer.outer.init, out_shardings=trainer._replicated)(_one_replica(p))
    outer_state = jobstate.reset_varying(outer_state, fresh)
    members = tuple(int(r) for r in np.flatnonzero(meta[2:]))
    trainer.membership.note(f"rejoined at round {int(meta[0])}, members {list(members)}")
    return JobState(p, inner_state, outer_state, int(meta[0]), int(meta[1]), members, True)


def save(trainer, directory: str, state) -> None:
    """Writes ``state`` to ``directory`` (orbax; see :func:`co2jax.engines.jobstate.save`)."""
    meta = {
        "round": int(state.round),
        "exchanges": int(state.exchanges),
        "members": [int(r) for r in state.members],
        "fresh": bool(state.fresh),
        "rank": trainer.peers.rank,
        "replicas": trainer.peers.replicas,
    }
    jobstate.save(directory, (state.params, state.inner_state, state.outer_state), meta)


def restore(trainer, directory: str, params: Any):
    """The state :meth:`save` wrote; ``params``: the initial parameters (for the shapes)."""
    local = trainer.init(params)
    target = (local.params, local.inner_state, local.outer_state)
    (p, inner_state, outer_state), meta = jobstate.restore(directory, target)
    if (meta.get("rank"), meta.get("replicas")) != (trainer.peers.rank, trainer.peers.replicas):
        raise ValueError(
            f"directory={directory!r} holds replica {meta.get('rank')} of "
            f"{meta.get('replicas')}, not replica {trainer.peers.rank} of {trainer.peers.replicas}"
        )
    members = tuple(meta["members"])
    return JobState(
        p,
        inner_state,
        outer_state,
        meta["round"],
        meta["exchanges"],
        members,
        meta["fresh"],
    )
