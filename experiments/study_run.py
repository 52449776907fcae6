"""Running a fidelity study (:mod:`experiments.studies`): ``compare --sweep <study>``.

The study's rows go through the comparison sweep in phases (a study whose later rows depend
on earlier results adds them once those ran), in worker processes that emulate as many
devices as the rows' meshes span (without XLA's persistent compilation cache, which is
unsafe for multi-device CPU programs: :mod:`co2jax.compilation_cache`); the report is
written with :mod:`experiments.study_reports`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from experiments import config as config_lib
from experiments import files as files_lib
from experiments import rundir
from experiments.report import exit_status
from experiments.studies import STUDIES, TITLES, seed_results, write_study


class Sweeper(NamedTuple):
    """What a study needs of the comparison sweep (``experiments.compare``, which imports
    this module, passes its own)."""

    run_sweep: Callable
    plan_sweep: Callable
    link: Callable
    error: type


# what only a sweep of rows uses (compare's flags): a study runs its own grid and models no link
SWEEP_ONLY = ("rows", "bandwidth_gbps", "latency_ms", "overlap_slowdown")


def command(args, parser, sweeper: Sweeper, reports) -> int:
    """``compare --sweep <study>``: runs it, prints its targets; returns the exit code.
    A flag only a sweep of rows uses and an ``--out`` it cannot write in are refused first
    (``parser.error``)."""
    given = [f"--preset={args.preset!r}"] if args.preset != "cpu-tiny" else []
    given += [
        f"--{name.replace('_', '-')}={getattr(args, name)!r}"
        for name in SWEEP_ONLY
        if getattr(args, name, None) is not None
    ]
    given += args.overrides
    if given:
        parser.error(
            f"--sweep {args.sweep} runs its own grid: no --preset, --rows, link flags or "
            f"overrides (given: {' '.join(given)})"
        )
    seeds = args.seeds or (1 if args.smoke else 3)
    out = Path(args.out or f"results/{args.sweep}" + ("-smoke" if args.smoke else ""))
    try:
        check_out_dir(out, args.out, "study.json")
    except ValueError as e:
        parser.error(str(e))
    print(f"co2jax compare: study {args.sweep}, {seeds} seed(s), writing {out}/report.md")
    began = time.perf_counter()
    try:
        rows, targets = run_study(
            args.sweep, out, sweeper, reports, smoke=args.smoke, seeds=seeds, rerun=args.rerun
        )
    except (sweeper.error, rundir.RunError) as e:  # a bad row, or --rerun over another's files
        print(f"co2jax compare: error: nothing ran: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("co2jax compare: interrupted; rerun the command to finish", file=sys.stderr)
        return 130
    for target in targets:
        print(target.line())
    print(f"report: {out / 'report.md'} ({time.perf_counter() - began:.0f} s)")
    return exit_status(rows)


def check_out_dir(out: Path, typed: str | None, *files: str) -> None:
    """Raises ``ValueError("--out='<typed>': <why>")``, one line, unless a sweep or a study
    can write in directory ``out`` (``typed``: as given, None for the default): no file or
    broken symlink on its path, and a directory can be made there (``files.
    directory_problem``: tried for real); where ``out`` exists, its ``runs`` is a directory
    if there and ``report.md`` and ``files`` can be written (``files.check_output_file``)."""
    if typed is not None and not typed.strip():
        raise ValueError(f"--out={typed!r}: names no directory")
    out = Path(out)
    shown = str(out) if typed is None else typed
    there = next(p for p in [out, *out.parents] if os.path.lexists(p) or p == Path(p.anchor))
    problem = getattr(files_lib, "directory_problem", _access_problem)  # files.py's, if there
    if os.path.lexists(there) and not there.exists():
        why = f"{there} is a broken symlink"
    elif there == out and there.exists() and not there.is_dir():
        why = "is a file" if there.is_file() else "is not a directory"
    else:
        why = problem(out)
    if why is None and there == out and (out / "runs").exists() and not (out / "runs").is_dir():
        why = f"its runs {out / 'runs'} is not a directory"
    try:
        if why is not None:
            raise ValueError(f"--out={shown!r}: {why}")
        if there == out:
            for name in ("report.md", *files):
                files_lib.check_output_file(out / name, "--out", shown, f"its {name}")
    except ValueError as e:
        raise ValueError(f"{e} (the default --out)" if typed is None else str(e)) from None


def _access_problem(out: Path) -> str | None:
    """Why ``out`` cannot be a directory written in, by its nearest existing ancestor's
    kind and permission bits."""
    there = next(p for p in [out, *out.parents] if p.exists() or p == Path(p.anchor))
    if not there.is_dir():
        return f"{there} is a file, not a directory"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{there} cannot be written in (no permission)"
    return None


def run_study(name, out, sweeper, reports, *, smoke=False, seeds=3, rerun=False):
    """Runs study ``name`` into ``out`` (finished runs reused unless ``rerun``) and writes its
    report with ``reports.<name>_report``; returns ``(rows, targets)``, the sweep's rows
    (status per row) and the targets.

    The runs go to worker processes, one per device count the rows' meshes span (each row's
    ``mesh.replica x mesh.data x mesh.model``): on CPU a worker emulates exactly that many
    devices, and fewer emulated devices run a small model's programs faster on a few cores
    (docs/experiments.md). This process starts no JAX backend: it plans and validates every
    row of a phase before any worker runs one, and reads the results from the run
    directories. A worker that dies fails its unfinished rows, and the study goes on."""
    base = config_lib.override(config_lib.preset("cpu-tiny"), ["log.progress=false"])
    out = Path(out)
    with _term_is_interrupt(), Workers() as workers:
        return _run_study(name, out, base, smoke, seeds, rerun, sweeper, reports, workers)


@contextlib.contextmanager
def _term_is_interrupt():
    """SIGTERM (a job scheduler's stop) ends the study as Ctrl-C does: the workers are told,
    finish their round and exit, rather than running on without this process."""

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# workers running at once. On 2 cores, two ran the scaling study's first phase (DP, bound by
# arithmetic) no faster than one (6.0 minutes against 5.7), but its H = 1 rows, bound by
# each round's dispatch and collectives, 31% faster (80k parameters, M = 4, 3 seeds twice:
# 52 s at once against 76 s one after the other)
LANES = 2
# an override that does not change a row's compiled programs where the row keeps it in the
# state (outer.lr_in_state): rows that differ only in it go to one worker, one after the
# other, so that the later ones run the first one's programs (programs.shared_programs)
_SAME_PROGRAM = "outer.learning_rate="


def row_devices(cfg: config_lib.Config, default: int = 8) -> int:
    """The devices a row's mesh spans (``default`` where a size is -1: it fills them)."""
    return cfg.mesh.devices or default


class Workers:
    """Worker processes by device count and lane, each started when first needed and kept for the
    study's later phases (its imports and in-memory compiled programs stay warm). Each one
    emulates its count of CPU devices."""

    def __init__(self):
        self._pools: dict[tuple, concurrent.futures.ProcessPoolExecutor] = {}
        self._busy: set[tuple] = set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for pool in self._pools.values():  # after an interrupt: each worker ends its round
            pool.shutdown(wait=True, cancel_futures=True)
        self._pools.clear()

    def interrupt(self) -> None:
        """Passes SIGINT on to the workers running a task (they are in process groups of
        their own, so a terminal's Ctrl-C reaches only this process): each training driver
        stops at its round's end, and its sweep raises KeyboardInterrupt."""
        for key in list(self._busy):
            pool = self._pools.get(key)
            for pid in list(getattr(pool, "_processes", None) or {}):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGINT)

    def call(self, devices: int, fn, *args, lane: int = 0):
        """``fn(*args)`` in worker ``lane`` of those with ``devices`` devices; its exception
        re-raised here (``BrokenProcessPool`` where the worker died: the next call starts a
        new one)."""
        key = devices, lane
        pool = self._pools.get(key)
        if pool is None:
            context = multiprocessing.get_context("spawn")  # a fork would copy JAX's threads
            pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=context, initializer=_worker_init, initargs=(devices,)
            )
            self._pools[key] = pool
        self._busy.add(key)
        try:
            return pool.submit(fn, *args).result()
        except concurrent.futures.process.BrokenProcessPool:
            del self._pools[key]
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            self._busy.discard(key)


def _worker_init(devices: int) -> None:
    """A worker's JAX settings, before its backend starts: ``devices`` emulated CPU devices
    (where it runs on CPU). The worker leaves the
    terminal's process group: an interrupt reaches it once, from :meth:`Workers.interrupt`
    (in a run the training driver stops at the round's end; between runs it raises)."""
    import jax

    if hasattr(os, "setpgrp"):
        os.setpgrp()
    jax.config.update("jax_num_cpu_devices", devices)


def _sweep_in_worker(run_sweep, link, base, out, sweep, seeds):
    return run_sweep(base, out, link(), sweep=sweep, seeds=seeds, report=False)


def _run_phase(sweep, plan, base, out, seeds, sweeper, workers) -> list[dict]:
    """The phase's rows: each device count's rows dealt over ``LANES`` workers, at most
    ``LANES`` running at once (fewest devices first); the sweep's row records in row order.
    Rows that differ only in a learning rate share a worker (:data:`_SAME_PROGRAM`)."""
    groups: dict[int, dict[tuple, list[int]]] = {}
    for i, entry in enumerate(plan):
        same = tuple(o for o in entry["overrides"] if not o.startswith(_SAME_PROGRAM))
        by_program = groups.setdefault(row_devices(entry["runs"][0]["cfg"]), {})
        by_program.setdefault(same, []).append(i)

    def steps(indices):  # a group's inner steps: the lanes get about as many each
        trains = [plan[i]["runs"][0]["cfg"].train for i in indices]
        return sum(t.rounds * t.sync_every for t in trains)

    tasks = []
    for devices, by_program in sorted(groups.items()):
        dealt = [[] for _ in range(min(LANES, len(by_program)))]
        load = [0] * len(dealt)
        for indices in sorted(by_program.values(), key=steps, reverse=True):
            lane = load.index(min(load))  # the longest group first, to the least loaded lane
            dealt[lane] += indices
            load[lane] += steps(indices)
        tasks += [(devices, lane, sorted(indices)) for lane, indices in enumerate(dealt)]

    def run(task):
        devices, lane, indices = task
        part = [sweep[i] for i in indices]
        try:
            args = (sweeper.run_sweep, sweeper.link, base, out, part, seeds)
            return indices, workers.call(devices, _sweep_in_worker, *args, lane=lane)
        except concurrent.futures.process.BrokenProcessPool as e:
            finished = seed_results([plan[i] for i in indices])
            rows = [{"label": label, "status": "done"} for label, _ in part]
            for row in rows:
                if len(finished[row["label"]]) < seeds:
                    row.update(status="failed", error=f"its worker ({devices} devices) died: {e}")
            return indices, rows

    swept: list[dict] = [{}] * len(plan)
    with concurrent.futures.ThreadPoolExecutor(LANES) as lanes:
        try:
            for indices, rows in lanes.map(run, tasks):
                for i, row in zip(indices, rows, strict=True):
                    swept[i] = row
        except KeyboardInterrupt:  # before the lanes are waited for: they wait on the workers
            workers.interrupt()
            raise
    return swept


def _run_study(name, out, base, smoke, seeds, rerun, sweeper, reports, workers):
    if rerun:  # every run again: the earlier ones go first, so no phase reuses them
        runs = out / "runs"
        for row in sorted(runs.iterdir()) if runs.is_dir() else []:
            rundir.remove_run(row)  # a run's directory, or refused: never the user's files
    rows, results, done = STUDIES[name](smoke), None, set()
    while True:  # a study whose later rows depend on earlier ones adds them once those ran
        sweep = [(r.label, list(r.overrides)) for r in rows]
        plan = sweeper.plan_sweep(base, out, sweep, seeds)  # every row checked before any runs
        swept = _run_phase(sweep, plan, base, out, seeds, sweeper, workers)
        results = seed_results(plan)
        done |= {r.label for r in rows}
        rows = STUDIES[name](smoke, results)
        if {r.label for r in rows} <= done:
            break
    report = getattr(reports, f"{name}_report")
    sections, targets, data = report(rows, results, out)
    failed = [r for r in swept if r["status"] == "failed"]
    if failed:
        sections += ["", "## Failed rows", ""]
        sections += [f"- {r['label']}: {r['error']}" for r in failed]
    sections += ["", f"Runs: {len(rows)} rows x {seeds} seed(s), under `{out}/runs`."]
    write_study(out, TITLES[name], sections, targets, data)
    return swept, targets
