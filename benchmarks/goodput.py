"""Goodput under repeated kills: R replica jobs, one killed at a random moment every k rounds.

    python -m benchmarks.goodput --replicas 4 --rounds 30 --kill-every 10 --pad-s 10

Runs R replica jobs (``benchmarks/faults_job.py``: the cpu-tiny transformer under
:class:`co2jax.JobTrainer`, DiLoCo, ``Peers(quorum=R-1)``, every round padded to ``--pad-s``
seconds by a sleep standing for a bigger model's compute) twice on one machine:

- ``free``: no fault;
- ``chaos``: every ``--kill-every`` rounds, once the last victim takes part again, a job is
  killed with SIGKILL at a random moment of a round (``--seed``) and started again at once
  with ``--rejoin``: the coordinator (rank 0) first, then a job drawn at random.

Both use JAX's persistent compilation cache (``--cache-dir``, one device per job: safe), so a
restarted job loads its programs; ``free`` runs first and fills it.

Reported (``--out``/report.md and summary.json):

- **goodput**: inner steps that reached the final anchor (H per participant of each
  round's exchange) over the steps the fault-free run does in the same wall time, both
  from the end of the first round (which compiles) to the last;
- **longest stall**: the survivors' longest ``wait_s`` (waiting for the exchange after the
  inner steps, in the rounds of each job before it is first killed) in the chaos run,
  beside the free run's, with the round it was in and whether that round waited for a job
  admitted at the end of the previous one (which starts late by the hand-over);
- whether every job's final anchor is the same, bit for bit (``co2jax.fingerprint``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.faults import Run, final_anchors, progress_rows
from experiments.files import write_atomic

REPO = Path(__file__).resolve().parent.parent


class Jobs(Run):
    """One run's R jobs on loopback (:class:`benchmarks.faults.Run`'s processes, started
    with the goodput options); every process killed on exit."""

    def __init__(self, name: str, args, out: Path):
        super().__init__(name, args, out)
        self.victims: list[dict] = []

    def start(self, rank: int, *extra: str) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "benchmarks.faults_job", "--rank", str(rank)]
        cmd += ["--peers", self.peers, "--mode", "tolerant", "--rounds", str(a.rounds)]
        cmd += ["--sync-every", str(a.sync_every), "--grace-s", str(a.grace_s)]
        cmd += ["--timeout-s", str(a.timeout_s), "--pad-s", str(a.pad_s)]
        cmd += ["--cache-dir", str(Path(a.cache_dir).resolve())]
        cmd += ["--progress", str(self.progress(rank)), *extra]
        log = open(self.out / f"job_{rank}.log", "ab")
        self.procs[rank] = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def rounds(self) -> dict[int, dict]:
        """Round -> a row of it (any job's: every job records the same participants)."""
        merged: dict[int, dict] = {}
        for r in range(self.args.replicas):
            for row in progress_rows(self.progress(r)):
                merged.setdefault(row["round"], row)
        return merged

    def _due(self, next_kill: int) -> bool:
        """``next_kill`` rounds done, and the last two with every job (the last victim back)."""
        rounds = self.rounds()
        if not rounds or max(rounds) + 1 < next_kill:
            return False
        every = [list(range(self.args.replicas))]
        last = [rounds.get(max(rounds) - i, {}).get("participants") for i in (0, 1)]
        return all(p == every for p in last)

    def execute(self, chaos: bool) -> None:
        a, R = self.args, self.args.replicas
        draw = random.Random(a.seed)
        for rank in range(R):
            self.start(rank)
        next_kill = a.kill_every
        deadline = time.monotonic() + a.deadline_s
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in self.procs.values()):
                failed = {r: p.returncode for r, p in self.procs.items() if p.returncode}
                if failed:
                    raise RuntimeError(f"{self.name}: jobs {failed} failed; see {self.out}")
                return
            if chaos and next_kill <= a.rounds - 5 and self._due(next_kill):
                # the coordinator (the lowest rank of the set) first, then any job at random
                victim = 0 if not self.victims else draw.randrange(R)
                time.sleep(draw.uniform(0, a.pad_s))  # a random moment of the round
                done = max(self.rounds()) + 1
                self.kill(victim)
                self.victims.append({"rank": victim, "after_round": done - 1, "at": time.time()})
                print(f"{self.name}: killed replica {victim} after round {done - 1}", flush=True)
                self.start(victim, "--rejoin")
                next_kill = done + a.kill_every
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: not done within {a.deadline_s} s; see {self.out}")

    def summary(self) -> dict:
        R = self.args.replicas
        rows = {r: progress_rows(self.progress(r)) for r in range(R)}
        rounds = self.rounds()
        first_end = min(row["end"] for r in rows for row in rows[r] if row["round"] == 0)
        last_end = max(row["end"] for r in rows for row in rows[r])
        useful = sum(
            row["steps"] * len(row["participants"][0]) for t, row in rounds.items() if t > 0
        )
        admitted_waits = {t + 1 for t, row in rounds.items() if row.get("admitted")}
        # the survivors: each job's rows before it was first killed (a job that came back
        # is not a survivor: its first rounds wait for the others' pace)
        first_kill = {}
        for k in self.victims:
            first_kill.setdefault(k["rank"], k["at"])
        survivors = {
            r: [row for row in rows[r] if row["end"] < first_kill.get(r, float("inf"))]
            for r in rows
        }
        stalls = sorted(
            (
                (row["wait_s"], row["round"], r, row["round"] in admitted_waits)
                for r in survivors
                for row in survivors[r]
                if row["round"] > 0
            ),
            reverse=True,
        )
        finals = {r: final_anchors(self.progress(r)) for r in range(R)}
        last = {f[-1] for f in finals.values() if f}
        return {
            "run": self.name,
            "rounds": len(rounds),
            "wall_s": last_end - first_end,
            "useful_steps": useful,
            "round_s": statistics.median(
                row["end"] - row["start"] for r in rows for row in rows[r] if row["round"] > 0
            ),
            "longest_stall_s": stalls[0][0],
            "longest_stalls": [
                {"wait_s": w, "round": t, "rank": r, "awaits_admitted": adm}
                for w, t, r, adm in stalls[:5]
            ],
            "longest_stall_not_awaiting_s": max(
                (w for w, t, r, adm in stalls if not adm), default=0.0
            ),
            "kills": self.victims,
            "anchors_agree": len(last) == 1 and all(finals.values()),
        }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--kill-every", type=int, default=10)
    parser.add_argument("--pad-s", type=float, default=10.0)
    parser.add_argument("--grace-s", type=float, default=2.0)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the jobs' timeout_s")
    parser.add_argument("--seed", type=int, default=0, help="which job dies, and when")
    parser.add_argument("--deadline-s", type=float, default=1800.0)
    parser.add_argument("--cache-dir", default="results/goodput/jax_cache")
    parser.add_argument("--out", default="results/goodput")
    args = parser.parse_args(argv)
    if args.replicas < 3:
        parser.error(f"--replicas must be >= 3 (a majority quorum of R-1), got {args.replicas}")
    if args.kill_every < 3 or args.kill_every > args.rounds - 5:
        parser.error(
            f"--kill-every must be in 3..rounds-5={args.rounds - 5} (a victim needs two rounds "
            f"to come back, and none is killed in the last 5), got {args.kill_every}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in ("free", "chaos"):
        run = Jobs(name, args, out)
        try:
            run.execute(chaos=name == "chaos")
        finally:
            run.close()
        results[name] = run.summary()
        print(json.dumps(results[name]), flush=True)
    free, chaos = results["free"], results["chaos"]
    rate = free["useful_steps"] / free["wall_s"]  # fault-free steps per second
    goodput = chaos["useful_steps"] / (rate * chaos["wall_s"])
    summary = {"goodput": goodput, "budget_stall_s": args.grace_s + 1.0, **results}
    write_atomic(out / "summary.json", json.dumps(summary, indent=1))
    report = [
        f"# Goodput: {args.replicas} jobs, cpu-tiny DiLoCo H={args.sync_every}, rounds padded "
        f"to {args.pad_s:g} s, {args.rounds} rounds, a kill every {args.kill_every} rounds, "
        f"grace_s={args.grace_s:g}",
        "",
        f"goodput {goodput:.1%} (target >= 85%); kills {[k['rank'] for k in chaos['kills']]}",
        "",
        "| run | rounds | wall (s) | median round (s) | steps to the anchor | survivors' "
        "longest wait (s) | the same, no admitted job awaited (s) | anchors agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (free, chaos):
        report.append(
            f"| {r['run']} | {r['rounds']} | {r['wall_s']:.1f} | {r['round_s']:.2f} | "
            f"{r['useful_steps']} | {r['longest_stall_s']:.2f} | "
            f"{r['longest_stall_not_awaiting_s']:.2f} | {r['anchors_agree']} |"
        )
    report += ["", f"stall budget: grace_s + 1 = {args.grace_s + 1:g} s; the chaos run's "
               f"longest waits: {chaos['longest_stalls']}"]  # fmt: skip
    write_atomic(out / "report.md", "\n".join(report) + "\n")
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
