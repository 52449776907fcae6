"""The slow-link testbed: R replica jobs in their own network namespaces, joined by shaped links.

    sudo python -m benchmarks.slowlink --replicas 2 --rate-mbit auto --rounds 6

Each replica is a separate process (``benchmarks/slowlink_job.py``: the cpu-tiny transformer
under :class:`co2jax.JobTrainer`) in its own network namespace. The namespaces hang
off a bridge in a hub namespace through veth pairs with private addresses (10.77.0.0/24);
``tc`` ``tbf`` limits each veth in both directions to ``--rate-mbit``. This kernel has no
``netem``, so link latency is not added by the network: ``--latency-ms`` makes the exchange
layer sleep before every pull, and says so.

For every algorithm (DDP through the same links, DiLoCo, CO2, delayed and eager DiLoCo) it
runs ``--rounds`` rounds (after one for compilation) and reports, per round: the measured
time, the compute-only time (the same R jobs with no exchange, running side by side, so the
CPU contention is the same), the time spent waiting for the exchange, the communication
time of one exchange (DiLoCo's wait: it exchanges after its compute, with nothing to hide
behind), and the fraction of it hidden:

    hidden = 1 - (round - compute_only) / communication     (clipped to [0, 1])

next to the cost model's prediction (``experiments.compare.simulated_round_s``, calibrated
here: step time and link rate measured, overlap slowdown fitted from CO2's compute time
under overlap). ``--rate-mbit auto`` picks the rate at which one DiLoCo exchange takes about
one round of compute. Namespaces and processes are removed on every exit path (also on
failure and Ctrl-C). Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "co2tb"
SUBNET = "10.77.0"
PORT = 7100
ALGORITHMS = ("ddp", "diloco", "co2", "delayed_diloco", "eager_diloco")
REPO = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _ns(i: int | str) -> str:
    return f"{PREFIX}-{i}"


class Testbed:
    """R namespaces on a shaped star (``with Testbed(R, rate) as tb``); removed on exit."""

    def __init__(self, replicas: int, rate_mbit: float):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got replicas={replicas!r}")
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got rate_mbit={rate_mbit!r}")
        self.replicas, self.rate_mbit = replicas, rate_mbit
        self.procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Testbed:
        cleanup()  # leftovers of a run that was killed
        try:
            hub = _ns("hub")
            _run("ip", "netns", "add", hub)
            _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", hub, "link", "set", "br0", "up")
            for i in range(self.replicas):
                ns, inside, outside = _ns(i), f"{PREFIX}{i}a", f"{PREFIX}{i}b"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
                _run("ip", "link", "set", inside, "netns", ns)
                _run("ip", "link", "set", outside, "netns", hub)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inside)
                _run("ip", "-n", ns, "link", "set", inside, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", hub, "link", "set", outside, "master", "br0")
                _run("ip", "-n", hub, "link", "set", outside, "up")
            self.shape(self.rate_mbit)
        except BaseException:
            cleanup()
            raise
        return self

    def shape(self, rate_mbit: float) -> None:
        """(Re)sets every link's rate, both directions (tbf on each end's egress)."""
        self.rate_mbit = rate_mbit
        burst = max(int(rate_mbit * 1e6 / 8 / 250), 16384)  # ~4 ms of traffic, >= 16 KB
        for i in range(self.replicas):
            for ns, dev in ((_ns(i), f"{PREFIX}{i}a"), (_ns("hub"), f"{PREFIX}{i}b")):
                with contextlib.suppress(subprocess.CalledProcessError):
                    _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")
                _run(
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{rate_mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "2s",
                )

    def link_bytes(self, i: int) -> int:
        """Bytes replica i's link carried out of its namespace so far (tc counters)."""
        out = subprocess.run(
            ["tc", "-n", _ns(i), "-s", "-j", "qdisc", "show", "dev", f"{PREFIX}{i}a"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return int(json.loads(out)[0]["bytes"])

    def launch(self, algorithm: str, ranks: list[int], solo: bool, args, out: Path) -> list[dict]:
        """Runs one job per rank (``solo``: each alone, no exchange) and returns their JSON."""
        addresses = ",".join(f"{self.address(i)}:{PORT}" for i in range(self.replicas))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
        env.pop("XLA_FLAGS", None)
        files = []
        for rank in ranks:
            peers = f"{self.address(rank)}:{PORT}" if solo else addresses
            target = out / f"{algorithm}{'-solo' if solo else ''}_{rank}.json"
            files.append(target)
            cmd = [
                "ip",
                "netns",
                "exec",
                _ns(rank),
                sys.executable,
                "-m",
                "benchmarks.slowlink_job",
                "--rank",
                str(0 if solo else rank),
                "--peers",
                peers,
                "--algorithm",
                algorithm,
                "--rounds",
                str(args.rounds),
                "--sync-every",
                str(args.sync_every),
                "--latency-ms",
                str(args.latency_ms),
                "--timeout-s",
                str(args.timeout_s),
                "--out",
                str(target),
            ]
            log = open(out / f"{target.stem}.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + args.timeout_s * 2
        try:
            while any(p.poll() is None for p in self.procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{algorithm}: the jobs did not finish; see {out}/*.log")
                time.sleep(0.1)
            bad = [p.returncode for p in self.procs if p.returncode]
            if bad:
                raise RuntimeError(f"{algorithm}: jobs exited with {bad}; see {out}/*.log")
        finally:
            self.kill()
        return [json.loads(f.read_text()) for f in files]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []

    def __exit__(self, *exc) -> None:
        self.kill()
        cleanup()


def cleanup() -> None:
    """Deletes every namespace of the testbed (their veths go with them)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _steady(runs: list[dict], key: str) -> float:
    """Median over rounds (the compiling round 0 left out) of the slowest job's value."""
    rounds = len(runs[0]["rows"])
    return statistics.median(max(r["rows"][k][key] for r in runs) for k in range(1, rounds))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rate-mbit", default="auto", help="link rate, or auto (see above)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--out", default="results/slowlink")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite report.md from the JSON of the last run in --out (no namespaces)",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        return rereport(args)
    if os.geteuid() != 0:
        parser.error("the testbed needs root (ip netns, tc)")
    algorithms = args.algorithms.split(",")
    for a in algorithms:
        if a not in ALGORITHMS:
            parser.error(f"--algorithms: {a!r} is not one of {ALGORITHMS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    rate = 1000.0 if args.rate_mbit == "auto" else float(args.rate_mbit)
    ranks = list(range(args.replicas))
    with Testbed(args.replicas, rate) as bed:
        solo = bed.launch("diloco", ranks, True, args, out)
        compute_only = _steady(solo, "round_s")
        payload = solo[0]["payload_bytes"]
        if args.rate_mbit == "auto":  # one exchange ((R-1) payloads up each link) ~ a round
            rate = payload * 8 * max(args.replicas - 1, 1) / compute_only / 1e6
            bed.shape(rate)
            # the exchange reaches only part of the link rate: rescale once on DiLoCo's wait
            comm = _steady(bed.launch("diloco", ranks, False, args, out), "wait_s")
            rate *= comm / compute_only
            bed.shape(rate)
        print(
            f"compute-only round {compute_only:.3f} s; payload {payload / 1e6:.2f} MB; "
            f"link {rate:.1f} Mbit/s; latency {args.latency_ms} ms (added by the exchange)"
        )
        results = {}
        for algorithm in algorithms:
            before = [bed.link_bytes(i) for i in ranks]
            runs = bed.launch(algorithm, ranks, False, args, out)
            crossed = [bed.link_bytes(i) - b for i, b in zip(ranks, before, strict=True)]
            results[algorithm] = {"runs": runs, "link_bytes": crossed}
            print(f"  {algorithm:<15} round {_steady(runs, 'round_s'):.3f} s", flush=True)
    summary = report(results, compute_only, payload, rate, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print((out / "report.md").read_text())


def rereport(args) -> None:
    """``report`` again from the files a run left in ``args.out``."""
    out = Path(args.out)
    previous = json.loads((out / "summary.json").read_text())
    ranks = range(args.replicas)
    solo = [json.loads((out / f"diloco-solo_{r}.json").read_text()) for r in ranks]
    results = {
        row["algorithm"]: {
            "runs": [json.loads((out / f"{row['algorithm']}_{r}.json").read_text()) for r in ranks],
            "link_bytes": row["link_bytes"],
        }
        for row in previous["rows"]
    }
    summary = report(
        results, _steady(solo, "round_s"), solo[0]["payload_bytes"], previous["rate_mbit"], args
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print((out / "report.md").read_text())


def report(results: dict, compute_only: float, payload: int, rate: float, args) -> dict:
    """Writes ``report.md`` with the measured table and the cost model next to it."""
    from experiments.compare import Link, simulated_round_s

    R = args.replicas
    comm = _steady(results["diloco"]["runs"], "wait_s") if "diloco" in results else None
    step_s = compute_only / args.sync_every
    # calibration: a fixed cost per exchange (thread, pulls, the outer step's dispatch),
    # fitted from DiLoCo's wait against the link's transfer time, as the per-peer latency
    # term; and the overlap slowdown from CO2's compute under overlap vs compute alone
    transfer = Link(bandwidth_gbps=rate / 1e3, latency_ms=0.0).exchange_s(payload, R)
    overhead = max(comm - transfer, 0.0) if comm else 0.0
    latency_ms = args.latency_ms + overhead * 1e3 / max(R - 1, 1)
    slowed = 0.0
    if "co2" in results:
        slowed = max(_steady(results["co2"]["runs"], "compute_s") / compute_only - 1.0, 0.0)
    link = Link(rate / 1e3, latency_ms, slowed)
    rows = []
    summary = {
        "compute_only_s": compute_only,
        "rate_mbit": rate,
        "payload_bytes": payload,
        "overhead_s": overhead,
        "overlap_slowdown": link.overlap_slowdown,
        "rows": [],
    }
    for algorithm, res in results.items():
        measured = _steady(res["runs"], "round_s")
        wait = _steady(res["runs"], "wait_s")
        hidden = None if not comm else min(max(1 - (measured - compute_only) / comm, 0.0), 1.0)
        name = "ddp" if algorithm == "ddp" else algorithm
        predicted = simulated_round_s(
            name, step_s, args.sync_every, payload, R, link, exchange="all_to_all"
        )
        row = {
            "algorithm": algorithm,
            "round_s": measured,
            "ratio": measured / compute_only,
            "wait_s": wait,
            "hidden": hidden,
            "predicted_s": predicted,
            "link_bytes": res["link_bytes"],
        }
        summary["rows"].append(row)
        rows.append(
            f"| {algorithm} | {measured:.3f} | {measured / compute_only:.2f} | {wait:.3f} | "
            + ("n/a" if hidden is None else f"{hidden:.0%}")
            + f" | {predicted:.3f} | {predicted / measured - 1:+.0%} |"
        )
    lines = [
        f"# Slow-link testbed: {R} replica jobs, {rate:.1f} Mbit/s per link",
        "",
        f"cpu-tiny transformer, H={args.sync_every}, payload {payload / 1e6:.2f} MB (float32); "
        f"compute-only round {compute_only:.3f} s; one exchange (DiLoCo's wait) "
        + ("n/a" if comm is None else f"{comm:.3f} s")
        + f"; latency {args.latency_ms} ms, added by the exchange layer (no netem). "
        f"Cost model calibrated here: link transfer {transfer:.3f} s plus a fixed "
        f"{overhead * 1e3:.0f} ms per exchange (fitted from DiLoCo's wait), overlap slowdown "
        f"{link.overlap_slowdown:.1%} (fitted from CO2's compute under overlap). Medians of "
        f"{args.rounds} rounds (after one that compiles), slowest job.",
        "",
        "| algorithm | round (s) | / compute-only | wait (s) | hidden | model (s) | model error |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    (Path(args.out) / "report.md").write_text("\n".join(lines))
    return summary


if __name__ == "__main__":
    try:
        main()
    finally:
        cleanup()
