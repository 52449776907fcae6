"""Fault tolerance between jobs: quorum exchanges, dropped peers, rejoin, trust checks, drift
and checkpoints (co2jax.engines.membership, jobstate, rejoin). Jobs are processes on
loopback (tests/ft_worker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ft_worker as worker
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax.engines import jobstate

# processes: each runs or kills processes under deadlines (.ci/run runs the slow ones
# in one pytest process, with nothing beside them)
pytestmark = pytest.mark.processes

TESTS = Path(__file__).parent
DEADLINE_S = 180


def _ports(n: int) -> list[int]:
    return harness.free_port_blocks(n, 1)  # below the ephemeral range


class Jobs:
    """Worker processes on loopback, killed at the deadline (a test never hangs)."""

    def __init__(self, out: Path, replicas: int = worker.REPLICAS):
        self.out = out
        self.addresses = ",".join(f"127.0.0.1:{p}" for p in _ports(replicas))
        self.procs: dict[tuple, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}

    def start(self, rank: int, mode: str) -> subprocess.Popen:
        log = open(self.out / f"{mode}_{rank}.log", "wb")
        cmd = [sys.executable, str(TESTS / "ft_worker.py"), str(rank), self.addresses]
        proc = subprocess.Popen(
            [*cmd, str(self.out), mode],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.procs[(rank, mode)] = proc
        return proc

    def wait(self, deadline: float) -> dict:
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()
        return {k: p.returncode for k, p in self.procs.items()}

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.out.glob("*.log"))

    def record(self, mode: str, rank: int) -> dict:
        return json.loads((self.out / f"{mode}_{rank}.json").read_text())


def _spmd_masked(masks: list) -> np.ndarray:
    """The SPMD round engine with these per-round participation masks: [rounds, R, dim]."""
    problem = worker.problem()
    H = tb.REGISTERED_H
    outer, inner = harness.registered("diloco", problem, worker.LR, H)
    mesh = co2jax.make_mesh(replica=worker.REPLICAS, data=1, devices=jax.devices("cpu")[:3])
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for mask in masks:
        state, _ = trainer.round(state, textbook_batch(problem, H), weights=mask)
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out)


def _mask(participants: list) -> list:
    return [1.0 if r in participants else 0.0 for r in range(worker.REPLICAS)]


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_dead_job_is_left_out_and_a_restarted_one_rejoins(tmp_path):
    """3 jobs, quorum 2: rank 2 dies before its round 2; ranks 0 and 1 go on without it
    (no restart of theirs, the loss of rank 2 named in every exchange they record); rank 2
    is started again, rejoins through JobTrainer.rejoin and from then on all three anchors
    are bit-identical, drift-checked every round, and the whole run equals the SPMD engine
    with the recorded participation as masks."""
    jobs = Jobs(tmp_path)
    for rank in (0, 1):
        jobs.start(rank, "survive")
    dying = jobs.start(2, "die")
    deadline = time.monotonic() + DEADLINE_S
    while dying.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    jobs.start(2, "rejoin")
    codes = jobs.wait(deadline)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    survivors = [jobs.record("survive", r) for r in (0, 1)]
    joined = jobs.record("rejoin", 2)
    rounds = {int(t): v for t, v in survivors[0]["rounds"].items()}
    assert all(s["error"] is None for s in (*survivors, joined)), jobs.logs()
    dropped = [t for t, v in rounds.items() if v["participants"] == [[0, 1]]]
    assert dropped and dropped[0] == worker.DIE_AT, rounds
    assert all("2" in rounds[t]["left_out"][0] for t in dropped)
    admitted = [t for t, v in rounds.items() if v["admitted"] == [2]]
    assert len(admitted) == 1 and joined["start_round"] == admitted[0] + 1
    for t, v in joined["rounds"].items():
        # its first round compiles its programs: it may be late for that one exchange
        first = int(t) == joined["start_round"]
        assert v["participants"] == [[0, 1, 2]] or (first and v["participants"] == [[0, 1]])
        for s in survivors:  # bit-identical anchors after the join
            assert s["rounds"][t]["params"] == v["params"], t
    assert max(rounds) == max(int(t) for t in joined["rounds"])
    masks = [_mask(rounds[t]["participants"][0]) for t in sorted(rounds)]
    want = _spmd_masked(masks)
    for t in sorted(rounds):
        for r, s in enumerate(survivors):
            np.testing.assert_allclose(
                s["rounds"][str(t)]["params"], want[t, r], rtol=1e-6, atol=1e-6
            )
    assert any("replica 2 left out" in e for e in survivors[0]["events"])
    assert any("replica 2 admitted" in e for e in survivors[0]["events"])


# the malformed case runs with -m slow: test_frames_are_checked covers every header check
@pytest.mark.parametrize(
    "mode, reason",
    [("nan", "non-finite"), pytest.param("malformed", "malformed", marks=pytest.mark.slow)],
)
@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_bad_payload_is_dropped_and_reported(tmp_path, mode, reason):
    """Rank 2's payload of round 1 is non-finite (a NaN batch) or malformed (a wrong
    header): the others drop it from that round and say why; rank 2 applies the same
    update, so all three continue bit-identical, as the SPMD engine with that mask."""
    jobs = Jobs(tmp_path)
    for rank in (0, 1):
        jobs.start(rank, "steady")
    jobs.start(2, mode)
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    records = [jobs.record("steady", 0), jobs.record("steady", 1), jobs.record(mode, 2)]
    bad = str(worker.POISON_AT)
    for rec in records:
        assert rec["rounds"][bad]["participants"] == [[0, 1]]
        assert rec["rounds"]["0"]["participants"] == [[0, 1, 2]]
    assert reason in records[0]["rounds"][bad]["left_out"][0]["2"]
    for t in records[0]["rounds"]:
        assert records[0]["rounds"][t]["params"] == records[2]["rounds"][t]["params"]
    masks = [_mask(records[0]["rounds"][str(t)]["participants"][0]) for t in range(3)]
    want = _spmd_masked(masks)
    np.testing.assert_allclose(
        records[1]["rounds"]["2"]["params"], want[2, 1], rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("bad", [2, 0], ids=["a_peer", "the_coordinator"])
@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_poisoned_job_restarts_and_takes_part_again(tmp_path, bad):
    """Inner heavy-ball SGD; job ``bad``'s batch of round 1 is NaN (job 0 coordinates the
    exchanges). Every job leaves its payload out of round 1 (the job itself included), the
    poisoned job restarts from the anchor with a fresh inner state, and all three take part
    in rounds 2 and 3; every job's parameters equal the SPMD engine's with the same poisoned
    batch and exclude_nonfinite=True. (Before: its momentum stayed NaN and it was left out of
    every later round; poisoned as the coordinator, it counted its own NaN payload, which
    the others lacked, and the round failed.)"""
    jobs = Jobs(tmp_path)
    for rank in range(worker.REPLICAS):
        jobs.start(rank, "poisoned" if rank == bad else "healthy")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    records = [
        jobs.record("poisoned" if r == bad else "healthy", r) for r in range(worker.REPLICAS)
    ]
    P, everyone = worker.POISON_AT, list(range(worker.REPLICAS))
    for rec in records:
        assert rec["rounds"][str(P)]["participants"] == [[r for r in everyone if r != bad]]
        assert "non-finite" in rec["rounds"][str(P)]["left_out"][0][str(bad)]
        for t in range(P + 1, P + 3):
            assert rec["rounds"][str(t)]["participants"] == [everyone], rec["rounds"][str(t)]
    problem, H = worker.problem(), tb.REGISTERED_H
    outer, _ = harness.registered("diloco", problem, worker.LR, H)
    mesh = co2jax.make_mesh(replica=worker.REPLICAS, data=1, devices=jax.devices("cpu")[:3])
    inner = optax.sgd(worker.LR, momentum=worker.MOMENTUM)
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H, exclude_nonfinite=True)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    for t in range(P + 3):
        batch = textbook_batch(problem, H)
        if t == P:
            batch = {**batch, "d": batch["d"].at[bad].multiply(jnp.nan)}
        state, _ = trainer.round(state, batch)
        want = np.asarray(harness.flatten(jax.device_get(state.params)), np.float64)
        for r, rec in enumerate(records):
            got = rec["rounds"][str(t)]["params"]
            np.testing.assert_allclose(got, want[r], rtol=1e-6, atol=1e-6, err_msg=f"{t} {r}")


@pytest.mark.slow  # test_drift.py injects a drift into the round engine's anchors quickly
def test_drift_between_jobs_is_detected(tmp_path):
    """Rank 1 starts from other parameters (another seed): the anchors' fingerprints differ
    after the first round, and every job raises DriftError naming the round and replica 1
    (the largest group, ranks 0 and 2, agree)."""
    jobs = Jobs(tmp_path)
    for rank in range(3):
        jobs.start(rank, "drift")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    for rank in range(3):
        error = jobs.record("drift", rank)["error"]
        assert error and error["replicas"] == [1] and error["round"] == 0, error


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_pull_with_a_wrong_key_gets_nothing(tmp_path):
    """Keys derived from the run's secret: a job with another secret names another
    transfer and receives nothing; with the secret the same payload arrives. The secret is
    not in the Peers' repr."""
    jobs = Jobs(tmp_path)
    jobs.start(0, "keys")
    assert jobs.wait(time.monotonic() + 60) == {(0, "keys"): 0}, jobs.logs()
    result = json.loads((tmp_path / "keys.json").read_text())
    assert result["wrong_pending_after_2s"] and "wrong" not in result, result
    assert result["right"] == [0.0, 1.0, 2.0, 3.0]
    assert worker.SECRET not in result["repr"] and "secret" not in result["repr"]


def test_keys_depend_on_the_secret_and_every_field():
    peers = co2jax.Peers(("a:1", "a:2", "a:3"), 0, secret="s" * 16)
    keys = {
        co2jax.engines.exchange.transfer_key(peers, kind, step, src, dst)
        for kind in ("payload", "decision", "hello", "welcome")
        for step in range(4)
        for src in range(3)
        for dst in range(3)
    }
    assert len(keys) == 4 * 4 * 3 * 3 and all(0 < k < 2**63 for k in keys)
    other = co2jax.Peers(("a:1", "a:2", "a:3"), 0, secret="t" * 16)
    assert co2jax.engines.exchange.transfer_key(other, "payload", 0, 0, 1) not in keys


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quorum=0), "quorum must be None or in 1..2"),
        (dict(quorum=3), "quorum must be None or in 1..2"),
        (dict(grace_s=-1), "grace_s"),
        (dict(quorum=1), r"^quorum=1 of 2 replicas is not a majority: .* allow_minority=True$"),
        (dict(quorum=1, allow_minority="yes"), "allow_minority must be True or False"),
        (dict(secret="short"), "at least 16 characters"),
    ],
)
def test_peers_fault_tolerance_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.Peers(("a:1", "a:2"), 0, **kwargs)


def test_a_majority_quorum_is_accepted_and_a_minority_one_needs_the_flag():
    assert co2jax.Peers(("a:1", "a:2", "a:3"), 0, quorum=2).tolerant
    assert co2jax.Peers(tuple(f"a:{p}" for p in range(1, 6)), 0, quorum=3).tolerant
    with pytest.raises(ValueError, match="quorum=2 of 4 replicas is not a majority"):
        co2jax.Peers(("a:1", "a:2", "a:3", "a:4"), 0, quorum=2)
    assert co2jax.Peers(("a:1", "a:2", "a:3", "a:4"), 0, quorum=2, allow_minority=True).tolerant


def test_frames_are_checked():
    leaves = [jnp.ones((2, 3)), jnp.arange(4, dtype=jnp.int32)]
    framed = jobstate.frame(leaves, 1, 7, 2.0)
    assert jobstate.check_frame(framed, framed, 1, 7) is None
    assert "names replica 1" in jobstate.check_frame(framed, framed, 2, 7)
    assert "exchange 7" in jobstate.check_frame(framed, framed, 1, 8)
    other = jobstate.frame([jnp.ones((3, 2)), leaves[1]], 1, 7, 2.0)
    assert "shapes or dtypes" in jobstate.check_frame(other, framed, 1, 7)
    nan = jobstate.frame([leaves[0].at[1, 1].set(jnp.inf), leaves[1]], 1, 7, 2.0)
    assert "non-finite" in jobstate.check_frame(nan, framed, 1, 7)
    negative = jobstate.frame(leaves, 1, 7, -1.0)
    assert "weight" in jobstate.check_frame(negative, framed, 1, 7)


def test_dylu_steps():
    assert jobstate.dylu_steps(32, [0.1, 0.2, 0.1]) == [32, 16, 32]
    assert jobstate.dylu_steps(32, [0.1, 1.0]) == [32, 5]  # the floor
    assert jobstate.dylu_steps(4, [0.1, 1.0]) == [4, 4]  # at most H
    with pytest.raises(ValueError, match="step_times"):
        jobstate.dylu_steps(32, [0.1, 0.0])


def test_reset_varying_takes_only_the_marked_fields():
    outer = co2jax.sparseloco(0.5, k=4, chunk=8)
    params = {"w": jnp.ones(16)}
    state = outer.init(params)
    used = jax.tree.map(lambda x: x + 3, state)
    reset = jobstate.reset_varying(used, state)
    assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(reset.residuals))
    np.testing.assert_array_equal(reset.inner_state.anchor["w"], used.inner_state.anchor["w"])


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_job_checkpoint_round_trip(tmp_path):
    """A one-job run saved after two rounds and restored into a new trainer: the same state,
    and the same next round; a checkpoint is never overwritten, a missing one is named."""
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=5)
    H = tb.REGISTERED_H
    outer, inner = harness.registered("sparseloco", problem, 0.1, H)
    mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices("cpu")[:1])
    batch = {k: v[0] for k, v in textbook_batch(problem, H).items()}
    params = harness.unflatten(jnp.asarray(problem.theta0, jnp.float32))

    def trainer():
        peers = co2jax.Peers((f"127.0.0.1:{_ports(1)[0]}",), 0)
        return co2jax.JobTrainer(engine_loss, inner, outer, peers, H, mesh)

    a = trainer()
    state = a.init(params)
    for _ in range(2):
        state, _ = a.round(state, batch)
    a.save(str(tmp_path / "ckpt"), state)
    with pytest.raises(ValueError, match="never overwritten"):
        a.save(str(tmp_path / "ckpt"), state)
    b = trainer()
    restored = b.restore(str(tmp_path / "ckpt"), params)
    assert (restored.round, restored.exchanges) == (2, state.exchanges) == (2, 2)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    next_a, _ = a.round(state, batch)
    next_b, _ = b.round(restored, batch)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(next_b), jax.device_get(next_a))
    with pytest.raises(ValueError, match="holds no complete job checkpoint"):
        b.restore(str(tmp_path / "nothing"), params)


def test_per_job_steps_are_token_weighted(tmp_path):
    """One job taking fewer steps weighs its steps: JobTrainer.round(steps=...) checked on a
    single job against the SPMD engine with per-replica steps (R = 1 reduces to its own)."""
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=5)
    H = tb.REGISTERED_H
    outer, inner = harness.registered("diloco", problem, 0.1, H)
    mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices("cpu")[:1])
    peers = co2jax.Peers((f"127.0.0.1:{_ports(1)[0]}",), 0)
    job = co2jax.JobTrainer(engine_loss, inner, outer, peers, H, mesh)
    params = harness.unflatten(jnp.asarray(problem.theta0, jnp.float32))
    state = job.init(params)
    batch = textbook_batch(problem, H)
    state, metrics = job.round(state, {k: v[0] for k, v in batch.items()}, steps=2)
    assert metrics.steps == 2 and metrics.losses.shape == (2,)
    spmd = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
    want, _ = spmd.round(spmd.init(params), batch, steps=[2])
    np.testing.assert_allclose(state.params["w"], want.params["w"], rtol=1e-6)
    with pytest.raises(ValueError, match=r"steps must be an integer in 1..H=4"):
        job.round(state, {k: v[0] for k, v in batch.items()}, steps=5)
    streaming, _ = harness.registered("streaming_diloco", problem, 0.1, H)
    peers2 = co2jax.Peers((f"127.0.0.1:{_ports(1)[0]}",), 0)
    job2 = co2jax.JobTrainer(engine_loss, optax.sgd(0.1), streaming, peers2, H, mesh)
    with pytest.raises(ValueError, match="sends or applies during the round"):
        job2.round(job2.init(params), {k: v[0] for k, v in batch.items()}, steps=2)


def test_clipped_mean_bounds_a_faulty_replica():
    from co2jax.comm.participation import clipped_mean

    rng = np.random.default_rng(0)
    honest = rng.normal(size=(3, 10))
    faulty = np.concatenate([honest, 1e6 * rng.normal(size=(1, 10))])
    got = np.asarray(clipped_mean({"g": jnp.asarray(faulty, jnp.float32)})["g"])
    norms = np.linalg.norm(faulty, axis=1)
    median = np.sort(norms)[1]  # the lower median of 4
    want = np.mean(faulty * np.minimum(1, median / norms)[:, None], axis=0)
    # float32 against float64: an entry near 0 (a cancellation) is held to float32's
    # absolute rounding of the terms (about 0.5), not to 1e-5 of itself
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(got - honest.mean(0)) < median  # not moved arbitrarily
    w = jnp.array([1.0, 2.0, 0.0, 1.0])  # a weight 0 replica counts in neither the median
    got = np.asarray(clipped_mean({"g": jnp.asarray(faulty, jnp.float32)}, w)["g"])
    median = np.sort(norms[[0, 1, 3]])[1]
    scale = np.asarray(w) * np.minimum(1, median / norms) / 4.0
    np.testing.assert_allclose(got, scale @ faulty, rtol=1e-5, atol=1e-6)


def test_robust_refuses_contributor_means():
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=5)
    outer, inner = harness.registered("sparseloco", problem, 0.1, tb.REGISTERED_H)
    mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices("cpu")[:1])
    peers = co2jax.Peers((f"127.0.0.1:{_ports(1)[0]}",), 0)
    job = co2jax.JobTrainer(engine_loss, inner, outer, peers, tb.REGISTERED_H, mesh, robust=True)
    with pytest.raises(ValueError, match="per index over contributors"):
        job.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))


@pytest.mark.slow  # the clip itself: test_clipped_mean_bounds_a_faulty_replica
def test_robust_jobs_bound_a_faulty_job(tmp_path):
    """robust=True: rank 2's round-1 payload is about 10^4 times the others'; clipped to
    the median norm, the anchor's step that round stays the size of an honest one."""
    jobs = Jobs(tmp_path)
    for rank in (0, 1):
        jobs.start(rank, "robust")
    jobs.start(2, "robust_huge")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    rounds = jobs.record("robust", 0)["rounds"]
    theta = [np.asarray(worker.problem().theta0)] + [
        np.asarray(rounds[str(t)]["params"]) for t in range(3)
    ]
    steps = [np.linalg.norm(theta[t + 1] - theta[t]) for t in range(3)]
    assert steps[1] < 5 * steps[0], steps
    assert jobs.record("robust_huge", 2)["rounds"]["2"]["params"] == rounds["2"]["params"]


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_late_payload_is_carried_into_the_next_exchange(tmp_path):
    """late="carry": rank 2 misses round 1's grace window; its payload, which arrives during
    round 2, is merged into the next exchange (weight 1/sqrt(2)) instead of being lost,
    and every job merges it alike (bit-identical anchors)."""
    jobs = Jobs(tmp_path)
    for rank in (0, 1):
        jobs.start(rank, "carry")
    jobs.start(2, "carry_late")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    records = [jobs.record("carry", 0), jobs.record("carry", 1), jobs.record("carry_late", 2)]
    rounds = records[0]["rounds"]
    assert rounds[str(worker.POISON_AT)]["participants"] == [[0, 1]]
    carried = [t for t, v in rounds.items() if v["carried"] == [[2]]]
    assert carried and int(carried[0]) > worker.POISON_AT, rounds
    for t in rounds:
        assert (
            records[1]["rounds"][t]["params"]
            == records[2]["rounds"][t]["params"]
            == (rounds[t]["params"])
        )
        assert records[2]["rounds"][t]["carried"] == rounds[t]["carried"]


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_the_coordinator_dying_hands_the_decisions_to_the_next_rank(tmp_path):
    """Rank 0, the coordinator, dies before its round DIE_AT: rank 1 (the next rank of the
    previous set) decides from then on; ranks 1 and 2 go on together, bit-identical."""
    jobs = Jobs(tmp_path)
    jobs.start(0, "die")
    for rank in (1, 2):
        jobs.start(rank, "outlive")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert set(codes.values()) == {0}, f"{codes}\n{jobs.logs()}"
    one, two = jobs.record("outlive", 1)["rounds"], jobs.record("outlive", 2)["rounds"]
    assert sorted(one) == sorted(two) == [str(t) for t in range(worker.DIE_AT + 3)]
    for t in one:
        want = [[0, 1, 2]] if int(t) < worker.DIE_AT else [[1, 2]]
        assert one[t]["participants"] == two[t]["participants"] == want, (t, one[t])
        assert one[t]["params"] == two[t]["params"]


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_coordinator_dying_while_it_decides_costs_one_grace_window(tmp_path):
    """Rank 0, the coordinator, dies in round DIE_AT after its payload went out and before
    its decision: ranks 1 and 2 hold its payload, so its connection has not failed, and
    waited for its decision, or for its side exchange, until timeout_s (60 s), or one of
    them lacked the payload the other counted. Now a silent candidate is probed after
    grace_s (a TCP connection, which a dead process refuses): the round costs at most
    grace_s + 1 s more than a round, and rank 1 decides without rank 0's payload; both go on
    bit-identical."""
    jobs = Jobs(tmp_path)
    jobs.start(0, "die_deciding")
    for rank in (1, 2):
        jobs.start(rank, "outlive")
    codes = jobs.wait(time.monotonic() + DEADLINE_S)
    assert codes[(0, "die_deciding")] == 3, f"{codes}\n{jobs.logs()}"
    assert codes[(1, "outlive")] == codes[(2, "outlive")] == 0, f"{codes}\n{jobs.logs()}"
    one, two = jobs.record("outlive", 1)["rounds"], jobs.record("outlive", 2)["rounds"]
    assert sorted(one) == sorted(two) == [str(t) for t in range(worker.DIE_AT + 3)]
    for t in one:
        assert one[t]["participants"] == two[t]["participants"], (t, one[t], two[t])
        assert one[t]["params"] == two[t]["params"]
    # the next rank decides without the dead coordinator's payload, which may have reached
    # one job and not the other
    assert one[str(worker.DIE_AT)]["participants"] == [[1, 2]]
    ends = [one[str(t)]["time"] for t in range(worker.DIE_AT + 3)]
    rounds = np.diff(ends)  # round k's length is ends[k] - ends[k - 1]
    normal = np.median(rounds[worker.DIE_AT :])
    stall = rounds[worker.DIE_AT - 1] - normal
    assert stall <= worker.GRACE_S + 1.0, (rounds, stall)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_rejoined_coordinator_dying_while_it_decides_costs_one_grace_window(tmp_path):
    """Rank 0 dies before its round DIE_AT; restarted, it rejoins and coordinates again (the
    lowest rank), and dies again in its second round, just before sending its decision.
    Ranks 1 and 2 go on: no round of theirs is longer than a normal one by more than
    grace_s + 1 s (the wait for the restarted job's first exchange aside, which waits for
    its hand-over and compilation), and their anchors stay bit-identical."""
    jobs = Jobs(tmp_path)
    dying = jobs.start(0, "die")
    for rank in (1, 2):
        jobs.start(rank, "survive")
    deadline = time.monotonic() + DEADLINE_S
    while dying.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    again = jobs.start(0, "rejoin_die_deciding")
    codes = jobs.wait(deadline)
    assert codes[(0, "rejoin_die_deciding")] == 3, f"{codes}\n{jobs.logs()}"
    assert codes[(1, "survive")] == codes[(2, "survive")] == 0, f"{codes}\n{jobs.logs()}"
    assert again.returncode == 3
    one, two = jobs.record("survive", 1)["rounds"], jobs.record("survive", 2)["rounds"]
    assert sorted(one) == sorted(two)
    for t in one:
        assert one[t]["participants"] == two[t]["participants"], (t, one[t], two[t])
        assert one[t]["params"] == two[t]["params"]
    admitted = [int(t) for t, v in one.items() if v["admitted"] == [0]]
    assert len(admitted) == 1, one
    ends = [one[str(t)]["time"] for t in range(len(one))]
    rounds = np.diff(ends)  # rounds[k - 1]: round k's length
    normal = np.median(rounds)
    # round admitted + 1 waits for the joiner (rounds[admitted]); in round DIE_AT the first
    # death is a job that lingers LINGER_S with its last payloads offered: alive, waited for
    waited = {admitted[0], worker.DIE_AT - 1}
    stalls = [x - normal for k, x in enumerate(rounds) if k not in waited]
    assert max(stalls) <= worker.GRACE_S + 1.0, (rounds, admitted)
    assert one[str(admitted[0] + 1)]["participants"] == [[0, 1, 2]], one


@pytest.mark.parametrize("name", ["ddp", "demo"])
def test_jobs_refuse_an_inner_transform_that_communicates_every_step(name):
    """DDP's and DeMo's inner transforms exchange every step over the replica axis, which
    separate jobs do not share: refused before any compute (it once trained each job alone,
    sending nothing). A per-round algorithm's inner SGD passes the same check."""
    problem = tb.make_problem(replicas=1, examples=2, dim=16, seed=5)
    mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices("cpu")[:1])
    params = harness.unflatten(jnp.asarray(problem.theta0, jnp.float32))
    for algorithm, refused in ((name, True), ("diloco", False)):
        outer, inner = harness.registered(algorithm, problem, 0.1, tb.REGISTERED_H)
        peers = co2jax.Peers((f"127.0.0.1:{_ports(1)[0]}",), 0)
        job = co2jax.JobTrainer(engine_loss, inner, outer, peers, tb.REGISTERED_H, mesh)
        if refused:
            with pytest.raises(ValueError, match="communicates over 'replica' every step"):
                job.init(params)
        else:
            job.init(params)


def test_offers_to_a_peer_found_gone_are_withdrawn():
    """Payloads offered to a peer that never pulls them stayed on the server until the job
    ended (one per exchange while it was away). Now the last KEPT_OFFERS exchanges' offers
    are tracked; when the peer is found gone they are taken back from the server, and
    nothing more is offered to it (an exchange fails it at once) until its server answers
    a connection again."""
    from co2jax.engines import exchange as ex

    ports = _ports(3)
    addresses = tuple(f"127.0.0.1:{p}" for p in ports)
    a = ex.Exchange(co2jax.Peers(addresses, 0))
    b = ex.Exchange(co2jax.Peers(addresses, 1))  # rank 2 never starts: a dead peer
    x = jnp.arange(1000.0)
    for step in range(ex.KEPT_OFFERS + 4):
        a.publish("payload", step, [x], [1, 2])
    assert a.outstanding(1) == a.outstanding(2) == ex.KEPT_OFFERS
    got = b.pull("payload", ex.KEPT_OFFERS + 3, 0, [x])  # a live peer's pull: served
    np.testing.assert_array_equal(got[0], x)
    a.lost(2)
    deadline = time.monotonic() + 10
    while a.withdrawn < ex.KEPT_OFFERS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.withdrawn == ex.KEPT_OFFERS and a.outstanding(2) == 0 and a.away == {2}
    a.publish("payload", 99, [x], [1, 2])
    assert a.outstanding(2) == 0 and a.outstanding(1) == ex.KEPT_OFFERS
    b.publish("payload", 100, [x], [0])  # (no pull may be left hanging at the process end)
    pending = a.start(100, [x], "exchange 100")  # rank 2 away: failed at once, not pulled
    assert 2 in pending.gone and "gone" in pending.failed[2]
    a.wait(pending, until=(1,))
    assert sorted(pending.arrived()) == [0, 1]
    assert a.away == {2}  # its port still refuses connections
    b.pull("payload", 100, 0, [x])
