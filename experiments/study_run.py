"""Running a fidelity study (:mod:`experiments.studies`): ``compare --sweep <study>``.

The study's rows go through the comparison sweep in phases (a study whose later rows depend
on earlier results adds them once those ran), under XLA's persistent compilation cache, and
its report is written with :mod:`experiments.study_reports`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from experiments import config as config_lib
from experiments.studies import STUDIES, TITLES, seed_results, write_study


class Sweeper(NamedTuple):
    """What a study needs of the comparison sweep (``experiments.compare``, which imports
    this module, passes its own)."""

    run_sweep: Callable
    plan_sweep: Callable
    link: Callable
    error: type


def command(args, parser, sweeper: Sweeper, reports) -> int:
    """``compare --sweep <study>``: runs it, prints its targets; returns the exit code."""
    if args.rows is not None or args.overrides or args.preset != "cpu-tiny":
        parser.error(f"--sweep {args.sweep} runs its own grid: no --preset, --rows or overrides")
    seeds = args.seeds or (1 if args.smoke else 3)
    out = Path(args.out or f"results/{args.sweep}" + ("-smoke" if args.smoke else ""))
    print(f"co2jax compare: study {args.sweep}, {seeds} seed(s), writing {out}/report.md")
    began = time.perf_counter()
    try:
        rows, targets = run_study(
            args.sweep, out, sweeper, reports, smoke=args.smoke, seeds=seeds, rerun=args.rerun
        )
    except sweeper.error as e:
        print(f"co2jax compare: error: nothing ran: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("co2jax compare: interrupted; rerun the command to finish", file=sys.stderr)
        return 130
    for target in targets:
        print(target.line())
    print(f"report: {out / 'report.md'} ({time.perf_counter() - began:.0f} s)")
    failed = [r["label"] for r in rows if r["status"] == "failed"]
    if failed:
        print(f"co2jax compare: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_study(name, out, sweeper, reports, *, smoke=False, seeds=3, rerun=False):
    """Runs study ``name`` into ``out`` (finished runs reused unless ``rerun``) and writes its
    report with ``reports.<name>_report``; returns ``(rows, targets)``, the sweep's rows
    (status per row) and the targets."""
    base = config_lib.override(config_lib.preset("cpu-tiny"), ["log.progress=false"])
    out = Path(out)
    with _compile_cache(out / ".compile-cache"):
        return _run_study(name, out, base, smoke, seeds, rerun, sweeper, reports)


@contextlib.contextmanager
def _compile_cache(path: Path):
    """XLA's persistent compilation cache in ``path`` while the study runs: the seeds of a
    row compile the same programs (3x fewer compiles, most of a small model's run time), and
    so does a study started again. The process's own settings come back afterwards."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (str(path), 0.0, 0), strict=True):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # the cache is set up at the first compile after this
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def _run_study(name, out, base, smoke, seeds, rerun, sweeper, reports):
    import jax

    if rerun:  # every run again: the earlier ones go first, so no phase reuses them
        import shutil

        shutil.rmtree(out / "runs", ignore_errors=True)
    rows, results, done = STUDIES[name](smoke), None, set()
    while True:  # a study whose later rows depend on earlier ones adds them once those ran
        sweep = [(r.label, list(r.overrides)) for r in rows]
        swept = sweeper.run_sweep(
            base,
            out,
            sweeper.link(),
            sweep=sweep,
            seeds=seeds,
            report=False,
        )
        plan = sweeper.plan_sweep(base, out, sweep, seeds, jax.device_count())
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
