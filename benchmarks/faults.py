"""The fault testbed: replica jobs killed and restarted, or one of them slower, on loopback.

    python -m benchmarks.faults --replicas 3 --rounds 30 --kill-every 5

Runs R replica jobs (``benchmarks/faults_job.py``: the cpu-tiny transformer under
:class:`co2jax.JobTrainer`, DiLoCo) in these scenarios, side by side on one machine:

- ``free`` (and ``free_seed1``, another seed: the seed noise): no failure;
- ``kill``: every ``--kill-every`` rounds (of rank 0) one replica (ranks 1..R-1 in turn) is
  killed with SIGKILL and started again at once; quorum R-1, and the restarted job comes
  back through :meth:`JobTrainer.rejoin`. The others never stop;
- ``kill_carry``: ``kill`` with ``late="carry"``: a payload that misses its exchange's grace
  window (a just-rejoined job running behind) is merged into the next one;
- ``kill_strict``: the same kills against synchronous DiLoCo without these features: the
  others fail at their next exchange, and every job restarts from the newest checkpoint
  they all have (one per round, the baseline's best case);
- ``slow_sync``: replica R-1 is 2x slower (``--slow``), synchronous DiLoCo waits for it;
- ``slow_dylu``: the same with DyLU (``dylu=True``): the slow job takes fewer steps,
  token-weighted.

Reported per scenario: the steady time per round (rank 0's median round after the first 3),
the wall time after the first round (which compiles), goodput (tokens that reached the
anchor per second of that wall time) relative to ``free``, final loss (the
last 3 rounds, every job), replica-rounds lost, global restarts. For the slow replica: the
fraction of the wall-clock gap between ``slow_sync`` and ``free`` that ``slow_dylu``
recovers. Writes ``--out``/report.md and summary.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from experiments.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = (
    "free", "free_seed1", "kill", "kill_carry", "kill_strict", "slow_sync", "slow_dylu"
)  # fmt: skip
WARMUP = 3


def loopback_addresses(n: int) -> str:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)


def json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress_rows(path: Path) -> list[dict]:
    """A job's progress rows, one per round it completed (every run of it, in order)."""
    return [row for row in json_lines(path) if "round" in row]


def final_anchors(path: Path) -> list[int]:
    """The fingerprints of the anchors a job ended with (one per run that finished)."""
    return [row["final"] for row in json_lines(path) if "final" in row]


class Run:
    """One scenario's jobs: started, killed and restarted; every process killed on exit."""

    def __init__(self, name: str, args, out: Path):
        self.name, self.args, self.out = name, args, out / name
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        self.peers = loopback_addresses(args.replicas)
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = self.kills = self.late_rejoins = self.killed_at = 0
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
        self.env.pop("XLA_FLAGS", None)

    def progress(self, rank: int) -> Path:
        return self.out / f"progress_{rank}.jsonl"

    def start(self, rank: int, *extra: str) -> None:
        a = self.args
        mode = {"kill_strict": "strict", "slow_sync": "strict", "slow_dylu": "dylu"}
        cmd = [sys.executable, "-m", "benchmarks.faults_job", "--rank", str(rank)]
        cmd += ["--peers", self.peers, "--mode", mode.get(self.name, "tolerant")]
        cmd += ["--rounds", str(a.rounds), "--sync-every", str(a.sync_every)]
        cmd += ["--seed", "1" if self.name == "free_seed1" else "0"]
        cmd += ["--progress", str(self.progress(rank)), "--timeout-s", str(a.timeout_s), *extra]
        if self.name == "kill_carry":
            cmd += ["--late", "carry"]
        if self.name.startswith("slow") and rank == a.replicas - 1:
            cmd += ["--slow", str(a.slow)]
        if self.name == "kill_strict":
            cmd += ["--ckpt", str(self.out / "ckpt")]
        log = open(self.out / f"job_{rank}.log", "ab")
        self.procs[rank] = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def kill(self, rank: int) -> None:
        p = self.procs.get(rank)
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def close(self) -> None:
        for rank in list(self.procs):
            self.kill(rank)

    def done(self) -> int:
        return len(progress_rows(self.progress(0)))

    def _due(self, at: int) -> bool:
        """Rank 0 has done ``at`` rounds, and ``--kill-every`` since the last kill, and (with
        a quorum of R - 1: one down at a time) two rounds in a row with every replica since."""
        rows = progress_rows(self.progress(0))
        if len(rows) < max(at, self.killed_at + self.args.kill_every):
            return False
        every = [list(range(self.args.replicas))]
        since = [r["participants"] == every for r in rows[self.killed_at :]]
        # two full rounds in a row: the last victim has caught up (its first rounds compile)
        return self.name == "kill_strict" or any(a and b for a, b in itertools.pairwise(since))

    def execute(self) -> None:
        a, R = self.args, self.args.replicas
        (self.out / "ckpt").mkdir()
        for rank in range(R):
            self.start(rank)
        kills = [k for k in range(a.kill_every, a.rounds, a.kill_every)]
        victim = 0
        deadline = time.monotonic() + a.deadline_s
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in self.procs.values()):
                if all(p.returncode == 0 for p in self.procs.values()):
                    return
                # a job restarted too near the end finds no one left to admit it
                if self.name in ("kill", "kill_carry") and self.procs[0].returncode == 0:
                    self.late_rejoins = sum(p.returncode != 0 for p in self.procs.values())
                    return
                if self.name != "kill_strict":
                    raise RuntimeError(f"{self.name}: a job failed; see {self.out}/job_*.log")
                self._restart_all()
            if self.name.startswith("kill") and kills and self._due(kills[0]):
                kills.pop(0)
                self.kills += 1
                self.killed_at = self.done()
                victim = victim % (R - 1) + 1
                self.kill(victim)
                if self.name != "kill_strict":
                    self.start(victim, "--rejoin")
                else:  # the others fail at their next exchange; then all restart
                    for rank in range(R):
                        if rank != victim:
                            self.procs[rank].wait(timeout=a.deadline_s)
                    self._restart_all()
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: not done within {a.deadline_s} s; see {self.out}")

    def _restart_all(self) -> None:
        """The baseline's global restart from the newest round every job saved."""
        self.close()
        saved = [  # complete checkpoints only: a job killed while saving leaves a partial one
            {
                int(p.name.split("_")[1])
                for p in (self.out / "ckpt").glob(f"round_*_{r}")
                if (p / "job.json").exists()
            }
            for r in range(self.args.replicas)
        ]
        common = set.intersection(*saved) if all(saved) else set()
        self.restarts += 1
        if self.restarts > 3 * self.args.rounds:
            raise RuntimeError(f"{self.name}: restarts keep failing; see {self.out}/job_*.log")
        extra = ("--restore-round", str(max(common))) if common else ()
        for rank in range(self.args.replicas):
            self.start(rank, *extra)

    def summary(self) -> dict:
        R = self.args.replicas
        logs = {r: progress_rows(self.progress(r)) for r in range(R)}
        last = {}  # (rank, round) -> the row of the run that counted (a redone round: the last)
        for r, rows in logs.items():
            for row in rows:
                last[(r, row["round"])] = row
        rounds = sorted({t for (_, t) in last})
        head = [last[(0, t)] for t in rounds]
        tps = head[0]["tokens_per_step"]
        useful = lost = 0
        for t, row in zip(rounds, head, strict=True):
            part = row["participants"][0] if row["participants"] else list(range(R))
            useful += sum(last[(r, t)]["steps"] * tps for r in part if (r, t) in last)
            for r in row["carried"][0] if row.get("carried") else []:  # merged a round late
                useful += last[(r, t - 1)]["steps"] * tps if (r, t - 1) in last else 0
                lost -= 1
            lost += R - len(part)
        lost += sum(len(rows) for rows in logs.values()) - len(last)  # redone rounds
        # from the end of the first (compiling) round of the first run to the end
        began, ended = logs[0][0]["end"], logs[0][-1]["end"]
        part = head[0]["participants"][0] if head[0]["participants"] else range(R)
        first = sum(last[(r, 0)]["steps"] * tps for r in part)
        loss = [row["loss"] for r in range(R) for row in logs[r][-3:]]
        # the steady pace: rank 0's median round after WARMUP rounds (each new DyLU step
        # count compiles once; the kills' wall time is in the goodput)
        ends = [row["end"] for row in logs[0]]
        paces = sorted(b - a for a, b in itertools.pairwise(ends[WARMUP:]))
        return {
            "scenario": self.name,
            "rounds": len(rounds),
            "round_s": paces[len(paces) // 2],
            "wall_s": ended - began,
            "goodput": (useful - first) / (ended - began),
            "loss": sum(loss) / len(loss),
            "replica_rounds_lost": lost,
            "global_restarts": self.restarts,
            "kills": self.kills,
            "rejoins_too_late": self.late_rejoins,
        }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=64)
    parser.add_argument("--kill-every", type=int, default=5)
    parser.add_argument("--slow", type=float, default=2.0)
    parser.add_argument("--deadline-s", type=float, default=900.0)
    parser.add_argument("--timeout-s", type=float, default=15.0, help="the jobs' timeout_s")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default="results/faults")
    args = parser.parse_args(argv)
    if args.replicas < 3:
        parser.error(f"--replicas must be >= 3 (a quorum of R-1 >= 2), got {args.replicas}")
    names = args.scenarios.split(",")
    for n in names:
        if n not in SCENARIOS:
            parser.error(f"--scenarios: {n!r} is not one of {SCENARIOS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        run = Run(name, args, out)
        try:
            run.execute()
        finally:
            run.close()
        results[name] = run.summary()
        print(json.dumps(results[name]), flush=True)
    summary = report(results, args, out)
    write_atomic(out / "summary.json", json.dumps(summary, indent=1))
    print((out / "report.md").read_text())


def report(results: dict, args, out: Path) -> dict:
    free = results.get("free")
    lines = [
        f"# Fault testbed: {args.replicas} replica jobs, cpu-tiny, DiLoCo, H={args.sync_every}, "
        f"{args.rounds} rounds",
        "",
        "| scenario | s / round (steady) | wall (s) | goodput vs free | final loss | "
        "replica-rounds lost | global restarts | kills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = f"{r['goodput'] / free['goodput']:.0%}" if free else "n/a"
        lines.append(
            f"| {name} | {r['round_s']:.2f} | {r['wall_s']:.1f} | {ratio} | {r['loss']:.4f} | "
            f"{r['replica_rounds_lost']} | {r['global_restarts']} | {r['kills']} |"
        )
    summary = {"rows": list(results.values())}
    if {"free", "slow_sync", "slow_dylu"} <= set(results):
        t_free, t_sync = results["free"]["round_s"], results["slow_sync"]["round_s"]
        t_dylu = results["slow_dylu"]["round_s"]
        recovered = (t_sync - t_dylu) / (t_sync - t_free) if t_sync > t_free else float("nan")
        summary["gap_recovered"] = recovered
        lines += ["", f"Slow replica ({args.slow}x): DyLU recovers {recovered:.0%} of the "
                  f"wall-clock gap between synchronous DiLoCo ({t_sync:.2f} s/round) and the "
                  f"failure-free run ({t_free:.2f} s/round): {t_dylu:.2f} s/round."]  # fmt: skip
    if {"free", "free_seed1"} <= set(results):
        noise = abs(results["free"]["loss"] - results["free_seed1"]["loss"])
        summary["seed_noise"] = noise
        lines += ["", f"Seed noise (free vs free_seed1, final loss): {noise:.4f}."]
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    return summary


if __name__ == "__main__":
    main()
