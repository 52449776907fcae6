"""Kill, interrupt and resume: the training command stopped at random moments, then resumed.

    python -m benchmarks.kill_resume --trials 12 --rounds 6

Runs ``python -m experiments.train --preset micro`` (a checkpoint every round) once without
a fault, then ``--trials`` times: the same run started afresh, sent SIGKILL, SIGTERM or
SIGINT (in turn) at a moment drawn uniformly from the start of the process to the end of
an uninterrupted run (start-up, compilation, a round, a checkpoint being written), then
``--resume`` until it completes. Each trial passes when the resumed run's metrics records
(every field but the wall-clock ones) equal the uninterrupted run's, round for round and
bit for bit, with no round missing or twice. Reported per signal: trials, passed, how the
run stopped (killed, or the exit code of a clean stop), rounds computed twice (those after
the last checkpoint), and resumes that were refused. Writes ``--out``/report.md and
summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIGNALS = ("SIGKILL", "SIGKILL", "SIGTERM", "SIGINT")
VOLATILE = ("seconds", "tokens_per_s")  # wall-clock fields: the only ones that may differ


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]


class Runs:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}

    def argv(self, name: str, *extra: str) -> list[str]:
        a = self.args
        return [
            sys.executable, "-m", "experiments.train", "--preset", "micro",
            "log.tensorboard=false", f"train.rounds={a.rounds}", "checkpoint.every=1",
            f"log.dir={self.out / name}", f"checkpoint.dir={self.out / name}-ckpt", *extra,
        ]  # fmt: skip

    def metrics(self, name: str) -> list[dict]:
        return _records(self.out / name / "micro" / "metrics.jsonl")

    def run(self, name: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.argv(name, *extra), cwd=REPO, env=self.env, capture_output=True, text=True
        )

    def trial(self, name: str, signum: str, delay: float) -> dict:
        proc = subprocess.Popen(
            self.argv(name), cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(delay)
        finished = proc.poll() is not None
        if not finished:
            proc.send_signal(getattr(signal, signum))
        err = proc.communicate(timeout=600)[1]
        kept = len(self.metrics(name))
        ckpt = self.out / f"{name}-ckpt"
        saved = sorted(int(p.name) for p in ckpt.glob("[0-9]*") if p.name.isdigit())
        resumes, refused = 0, []
        while len(self.metrics(name)) < self.args.rounds or resumes == 0:
            done = self.run(name, "--resume")
            resumes += 1
            if done.returncode != 0:
                refused.append(done.stderr.strip().splitlines()[-1] if done.stderr else "")
                done = self.run(name, "--overwrite")  # what an operator would do next
            if resumes > 3:
                break
        return {
            "signal": signum,
            "delay_s": delay,
            "finished_first": finished,
            "exit": proc.returncode,
            "stopped_with": err.strip().splitlines()[-1][:200] if err.strip() else "",
            "records_before_resume": kept,
            "resumes": resumes,
            "refused": refused,
            "checkpoints_at_stop": saved,
            "records": self.metrics(name),
        }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/kill_resume")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.rounds < 2:
        parser.error(f"--trials >= 1 and --rounds >= 2, got {args.trials}, {args.rounds}")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    runs, draw = Runs(args), random.Random(args.seed)
    began = time.monotonic()
    straight = runs.run("straight")
    span = time.monotonic() - began
    if straight.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{straight.stderr[-2000:]}")
    want = runs.metrics("straight")
    trials = []
    for i in range(args.trials):
        signum = SIGNALS[i % len(SIGNALS)]
        t = runs.trial(f"trial{i}", signum, draw.uniform(0.2, span))
        t["passed"] = t.pop("records") == want
        # rounds recomputed: recorded before the stop but after its last checkpoint
        t["recomputed"] = max(t["records_before_resume"] - max(t["checkpoints_at_stop"] or [0]), 0)
        trials.append(t)
        print(json.dumps(t), flush=True)
    rows = []
    for signum in dict.fromkeys(SIGNALS):
        ts = [t for t in trials if t["signal"] == signum]
        rows.append(
            {
                "signal": signum,
                "trials": len(ts),
                "passed": sum(t["passed"] for t in ts),
                "finished_before_the_signal": sum(t["finished_first"] for t in ts),
                "refused_resumes": sum(len(t["refused"]) for t in ts),
                "exit_codes": sorted({t["exit"] for t in ts}),
            }
        )
    summary = {"uninterrupted_s": span, "rounds": args.rounds, "rows": rows, "trials": trials}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# Kill and resume: micro preset, {args.rounds} rounds, a checkpoint every round, "
        f"signals at a uniform moment of a {span:.1f} s uninterrupted run",
        "",
        "| signal | trials | resumed bit for bit | finished before the signal | "
        "resumes refused | exit codes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['signal']} | {r['trials']} | {r['passed']} | "
            f"{r['finished_before_the_signal']} | {r['refused_resumes']} | {r['exit_codes']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
