"""The comparison report: every algorithm on the same tokens, one table and three plots.

    python -m experiments.compare --preset cpu-tiny

Runs the preset once per algorithm (DDP, Local SGD, DiLoCo, naive delayed DiLoCo, eager
DiLoCo, CO2 without and with penalty and clip, DiLoCo with int8 pseudo-gradients, Streaming
DiLoCo in float32 and FP4, SparseLoCo) on the emulated 8-device CPU mesh (4 replicas x
2 data shards), then writes ``results/<preset>/report.md`` with the table (final eval loss,
excess over the data's entropy floor, bytes sent per replica, ratio to DDP, tokens/s,
modelled wall clock) and PNG plots of loss against tokens, bytes and modelled wall clock.

A sweep is robust to its users:

- every row's full config is resolved and validated before the first run starts; an invalid
  row refuses the whole sweep with a one-line error naming the row (exit code 2);
- each run's resolved config has a content hash (SHA-256 of its canonical JSON); a run whose
  ``runs/<row>/result.json`` is present with the same hash is reused, not rerun (``--rerun``
  runs everything again);
- ``report.md``, ``summary.json`` and the plots are rewritten after every row; a row that
  raises is recorded with its error and the sweep goes on (exit code 1 at the end);
- Ctrl-C leaves a valid partial report (the rows not reached are marked "not run") and
  exits with 130;
- a bad flag, a flag the sweep would ignore or an ``--out`` it cannot write in is refused in
  one line before anything runs; a command-line override that a row runs without (it sets
  the setting itself, or its algorithm has none) is one ``warning:`` line per row.

The modelled wall clock combines the measured compute time per inner step with a cost model
of the link between replicas: a ring all-reduce of N bytes over R replicas costs
``2 (R-1)/R * N * 8 / bandwidth + 2 (R-1) * latency``. Synchronous algorithms wait for it; an
algorithm whose reduction is overlapped (sent before the round's inner steps) hides it behind
the round's compute, up to that compute, and slows the overlapped compute by
``overlap_slowdown`` (18.9% on average measured on A100/H100/MI250, arXiv 2507.03114).
"""

from __future__ import annotations

# The command's first line: a Ctrl-C while JAX loads is kept, not dropped in its
# garbage-collection callback (experiments.interrupts; main() then restores the handlers)
from experiments import interrupts

if __name__ == "__main__":
    interrupts.install_early()

import argparse
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from co2jax.algorithms import registry
from experiments import checks, programs, rundir, study_reports, study_run, train
from experiments import config as config_lib
from experiments import model as model_lib
from experiments.files import write_atomic
from experiments.report import exit_status, progress_line, write_report
from experiments.studies import STUDIES
from experiments.sweep_rows import (
    ABLATIONS,
    COMPRESSION,
    PRESET_FIXES,
    SWEEP,
    Link,
    row_flag,
    summarise,
)

# the cost model is documented as experiments.compare.simulated_round_s (benchmarks import it)
from experiments.sweep_rows import simulated_round_s as simulated_round_s

RESULT = "result.json"  # a finished run: {"hash", "label", "history", "entropy_rate", "run_s"}


# ---------------------------------------------------------------------------------------------
# the sweep: planned and validated up front, one row at a time, finished runs reused


class SweepError(ValueError):
    """A row whose config cannot run: raised before any run starts."""


def config_hash(cfg: config_lib.Config) -> str:
    """The content hash of a resolved config: SHA-256 of its canonical JSON (sorted keys, no
    whitespace), first 16 hex digits. Equal configs hash equally in any process."""
    text = json.dumps(config_lib.to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def validate_config(cfg: config_lib.Config, device_count: int | None = None) -> None:
    """Every check that can run before training: the experiment config's whole validation
    (fields, the outer algorithm through the registry, the model, the mesh against
    ``device_count``), what the config names on disk (``checks.check_paths``, where the config
    module has it) and the model's shape. Raises ValueError naming the field."""
    checks.validate(cfg, device_count)
    check_paths = getattr(checks, "check_paths", None)
    if check_paths is not None:
        check_paths(cfg)
    sizes = {
        k: v
        for k, v in dataclasses.asdict(cfg.model).items()
        if k in ("d_model", "n_layers", "n_heads", "d_ff") and v is not None
    }
    model_lib.preset(
        cfg.model.preset,
        vocab_size=max(int(cfg.data.vocab_size), 1),  # the data may set it; checked there
        max_seq_len=cfg.data.seq_len,
        dtype=cfg.model.dtype,
        **sizes,
    )


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _outer_hyper(cfg: config_lib.Config) -> dict:
    """The outer algorithm's name and its settings that differ from their defaults."""
    default = dataclasses.asdict(registry.settings(cfg.outer.algorithm))
    return {
        k: v
        for k, v in dataclasses.asdict(cfg.outer).items()
        if k == "algorithm" or v != default[k]
    }


def plan_sweep(
    base: config_lib.Config,
    out: Path,
    sweep=SWEEP,
    seeds: int = 1,
    device_count: int | None = None,
    fixes: dict[str, list[str]] | None = None,
    command_line: Sequence[str] = (),
) -> list[dict]:
    """Resolves and validates every run of every row before anything runs.

    ``fixes`` maps an algorithm to overrides applied before the row's own to the rows that
    run it (:data:`PRESET_FIXES`). Returns one entry per row: ``label``, ``overrides`` (the
    fix's and the row's), ``slug``, ``runs`` (per seed: the resolved ``cfg``, its ``dir``
    under ``out/runs`` and its content ``hash``) and ``warning`` (one line or None: the
    ``command_line`` overrides, those ``base`` was given, that the row sets itself or its
    algorithm does not have). Raises :class:`SweepError` with one line naming the first bad
    row, its overrides and the refused setting (and where it came from), or a command-line
    override that no row runs with.
    """
    plan, slugs, missed = [], {}, {}
    for index, (label, row_overrides) in enumerate(sweep, 1):
        named = f"row {index} {label!r} [{' '.join(row_overrides) or 'no overrides'}]"
        try:
            algorithm = config_lib.override(base, list(row_overrides)).outer.algorithm
        except ValueError as e:
            raise SweepError(f"{named}: {_refused(e, row_overrides, command_line)}") from None
        mine = _keys(row_overrides)  # a fix the row sets itself goes
        fix = [item for item in (fixes or {}).get(algorithm, []) if _key(item) not in mine]
        overrides = [*fix, *row_overrides]
        carried, warning = _command_line(label, algorithm, overrides, command_line, missed)
        slug = _slug(label)
        if slug in slugs:
            raise SweepError(f"{named}: its run directory runs/{slug} is row {slugs[slug]}'s")
        slugs[slug] = index
        runs = []
        for k in range(seeds):
            seed = base.train.seed + k
            suffix = f"-seed{seed}" if k else ""
            run_dir = out / "runs" / (slug + suffix)
            # a preset that checkpoints: each run in its own directory, not one shared by all
            own = [f"checkpoint.dir={run_dir / 'checkpoints'}"] if base.checkpoint.dir else []
            named_seed = [f"name={base.name}-{slug}{suffix}", f"train.seed={seed}"]
            try:
                cfg = config_lib.override(base, [*own, *carried, *overrides, *named_seed])
                validate_config(cfg, device_count)
            except ValueError as e:
                raise SweepError(f"{named}: {_refused(e, overrides, command_line)}") from None
            runs.append({"cfg": cfg, "dir": run_dir, "hash": config_hash(cfg)})
        entry = {"label": label, "overrides": list(overrides), "slug": slug, "runs": runs}
        plan.append({**entry, "warning": warning})
    unused = [item for item, why in missed.items() if len(why) == len(plan)]
    if unused:  # an override no row runs with: nothing it sets is used
        why = missed[unused[0]]
        more = f"; and {len(why) - 3} more rows" if len(why) > 3 else ""
        raise SweepError(f"{unused[0].strip()} reaches no row: {'; '.join(why[:3])}{more}")
    return plan


def _key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def _same(a: str, b: str) -> bool:
    """Two overrides set the same value (``1`` and ``1.0``, ``True`` and ``true`` alike)."""
    x, y = (item.split("=", 1)[1].strip().lower() for item in (a, b))
    try:
        return x == y or float(x) == float(y)
    except ValueError:
        return False


def _command_line(label, algorithm, overrides, command_line, missed) -> tuple[list, str | None]:
    """The command line's ``outer.*`` overrides that row ``label`` runs with (applied again
    after its algorithm is set: switching it keeps only the settings that differ from the
    previous algorithm's defaults), and the row's warning: the overrides it sets itself
    (``outer.algorithm`` aside: a row is an algorithm) or its algorithm does not have.
    ``missed`` (override -> why, per row) collects the overrides the row runs without."""
    names = {f.name for f in dataclasses.fields(registry.REGISTRY[algorithm])}
    own = {_key(item): item.strip() for item in overrides}
    carried, over, lacking = [], [], []
    for item in command_line:
        key, typed = _key(item), item.strip()
        if key == "outer.algorithm":
            continue
        if key in own:
            if not _same(item, own[key]):
                over.append((typed, own[key]))
                missed.setdefault(item, []).append(f"{label!r} sets {own[key]}")
        elif key.startswith("outer.") and key[len("outer.") :] not in names:
            lacking.append(typed)
            missed.setdefault(item, []).append(f"{label!r} runs {algorithm}, without {key}")
        elif key.startswith("outer."):
            carried.append(item)
    parts = []
    if over:
        mine, theirs = (", ".join(x) for x in zip(*over, strict=True))
        parts.append(f"sets {theirs} over the command line's {mine}")
    if lacking:
        keys = ", ".join(map(_key, lacking))
        verb = "does" if len(lacking) == 1 else "do"
        parts.append(
            f"runs {algorithm}, which has no {keys}: the command line's "
            f"{', '.join(lacking)} {verb} not apply to it"
        )
    return carried, (f"warning: row {label!r} " + "; ".join(parts)) if parts else None


def _keys(overrides: Sequence[str]) -> set[str]:
    return {_key(item) for item in overrides}


def _refused(error: ValueError, overrides: Sequence[str], command_line=()) -> str:
    """The refusal on one line, naming the override as typed where one set the field, and
    where the setting came from when not from the row."""
    typed = getattr(error, "typed", None)  # experiments.config.ConfigError
    text = typed([*command_line, *overrides]) if callable(typed) else str(error)
    text = " ".join(text.split())
    key = getattr(error, "key", None) or str(error).split("=", 1)[0].split(":", 1)[0].strip()
    if key in _keys(overrides):
        return text
    if key in _keys(command_line):
        return f"{text} (set on the command line)"
    return f"{text} (from the preset or the defaults)"


def run_one(cfg: config_lib.Config, run_dir: Path, label: str | None = None) -> dict:
    """Trains one run of one row: ``{"history": [...], "entropy_rate": float | None}``;
    ``label``: its progress bar's (on a terminal; gone when the run ends)."""
    result = train.train_validated(cfg, out_dir=str(run_dir), progress=label)
    return {"history": result.history, "entropy_rate": result.entropy_rate}


def _load_result(run: dict) -> dict | None:
    """The run's finished result if its file is there and was made from the same config."""
    path = run["dir"] / RESULT
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("hash") != run["hash"]:
        return None
    if not record.get("history"):
        return None
    return record


def _base_row(entry: dict, out: Path) -> dict:
    first = entry["runs"][0]
    cfg = first["cfg"]
    return {
        "label": entry["label"],
        "status": "not run",
        "algorithm": cfg.outer.algorithm,
        "overrides": entry["overrides"],
        "hyper": _outer_hyper(cfg),
        "hash": first["hash"],
        "config": os.path.relpath(first["dir"] / "config.json", out),
        "vocab_size": cfg.data.vocab_size,
    }


def _run_row(entry: dict, out: Path, link: Link, rerun: bool) -> dict:
    """One row: each seed's run reused or trained; a run that raises fails the row (its error
    recorded on one line); KeyboardInterrupt goes through."""
    row = _base_row(entry, out)
    losses, summary, ran, reused = [], None, 0, 0
    try:
        for run in entry["runs"]:
            cfg, run_dir = run["cfg"], run["dir"]
            record = None if rerun else _load_result(run)
            if record is None:
                # the sweep owns runs/<row>: what an earlier, unfinished or stale run left
                # there goes (the training driver refuses a directory holding another run)
                rundir.remove_run(run_dir)
                began = time.perf_counter()
                seed = f" seed {cfg.train.seed}" if len(entry["runs"]) > 1 else ""
                done = run_one(cfg, run_dir, entry["label"] + seed)
                record = {
                    "hash": run["hash"],
                    "label": entry["label"],
                    "history": done["history"],
                    "entropy_rate": done["entropy_rate"],
                    "run_s": time.perf_counter() - began,
                }
                write_atomic(run_dir / RESULT, json.dumps(record))
                ran += 1
            else:
                reused += 1
            history = record["history"]
            losses.append(float(history[-1]["eval_loss"]))
            if summary is None:
                summary = summarise(
                    entry["label"], cfg, history, record["entropy_rate"], link, record["run_s"]
                )
    except Exception as e:  # any failure of one row: recorded, and the sweep goes on
        if _is_interrupt(e):  # Ctrl-C that the driver turned into a stop at a round's end
            raise KeyboardInterrupt(str(e)) from e
        for run in entry["runs"]:  # the report links each row's config, ran or not
            if not (run["dir"] / "config.json").exists():
                write_atomic(run["dir"] / "config.json", config_lib.to_json(run["cfg"]))
        row.update(status="failed", error=_one_line(e), ran=ran, reused=reused)
        return row
    row.update(summary)
    row.update(status="done", ran=ran, reused=reused, seed_losses=losses)
    row["eval_loss"] = float(np.mean(losses))
    row["eval_std"] = float(np.std(losses, ddof=1)) if len(losses) > 1 else None
    if row["entropy"] is not None:
        row["excess"] = row["eval_loss"] - row["entropy"]
    row["flag"] = row_flag(row)
    return row


def _is_interrupt(error: BaseException) -> bool:
    """The training driver's stop on SIGINT/SIGTERM (``train.Interrupted``, where it has one)."""
    interrupted = getattr(train, "Interrupted", None)
    return isinstance(interrupted, type) and isinstance(error, interrupted)


def run_sweep(
    base: config_lib.Config,
    out: Path,
    link: Link,
    sweep=SWEEP,
    seeds: int = 1,
    *,
    rerun: bool = False,
    report: bool = True,
    fixes: dict[str, list[str]] | None = None,
    command_line: Sequence[str] = (),
) -> list[dict]:
    """One row per entry of ``sweep``. With ``seeds > 1`` each entry also runs with
    ``train.seed`` + 1, + 2, ...: the row keeps the first seed's curves and reports the final
    eval loss's mean and seed-to-seed standard deviation.

    Every row is validated first (:class:`SweepError`, nothing run). A run whose result file
    matches its config hash is reused unless ``rerun``. With ``report``, ``out/report.md`` and
    the plots are rewritten after every row; on KeyboardInterrupt the report (rows done so far,
    the rest "not run") is written and the interrupt re-raised.
    """
    out = Path(out)
    programs.setup_devices(base)  # before the first device query starts JAX's backend
    import jax

    plan = plan_sweep(base, out, sweep, seeds, jax.device_count(), fixes, command_line)
    for entry in plan:  # a command-line override a row runs without
        if entry["warning"]:
            print(entry["warning"], file=sys.stderr, flush=True)
    rows = [_base_row(entry, out) for entry in plan]
    try:
        with programs.shared_programs():  # a row's seeds run one set of compiled programs
            for i, entry in enumerate(plan):
                rows[i] = row = _run_row(entry, out, link, rerun)
                print(progress_line(row, seeds), flush=True)
                if report:
                    write_report(rows, base, out, link)
    except KeyboardInterrupt:
        if report:
            write_report(rows, base, out, link, interrupted=True)
        raise
    return rows


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")


class _Parser(argparse.ArgumentParser):
    """argparse's refusals on one line, without the usage block."""

    def error(self, message):
        self.exit(2, f"co2jax compare: error: {' '.join(message.split())}\n")


# the link's flags: (Link field, lowest value, > or >=); the defaults are Link's
LINK_FLAGS = {
    "--bandwidth-gbps": ("bandwidth_gbps", ">"),
    "--latency-ms": ("latency_ms", ">"),
    "--overlap-slowdown": ("overlap_slowdown", ">="),
}


def _link(args, parser) -> Link:
    """The cost model's link from the flags as typed: each a finite number > 0 (a slowdown
    >= 0)."""
    values = {}
    for flag, (name, op) in LINK_FLAGS.items():
        text = getattr(args, name)
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            parser.error(f"{flag}={text!r}: expected a number")
        if not (math.isfinite(value) and (value > 0 if op == ">" else value >= 0)):
            parser.error(f"{flag}={text!r}: must be a finite number {op} 0")
        values[name] = value
    return Link(**values)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code: 0, 1 (a row failed), 2 (a bad config or
    argument: nothing ran) or 130 (interrupted: the partial report is written)."""
    early = interrupts.release_early()
    if early is not None:
        name = signal.Signals(early).name
        print(f"co2jax compare: {name} during start-up: nothing ran", file=sys.stderr)
        return 128 + early
    parser = _Parser(description="co2jax comparison report")
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(config_lib.PRESETS))
    parser.add_argument("--out", default=None, help="default: results/<preset>")
    link_help = {
        "--bandwidth-gbps": "each replica's link in Gbit/s, > 0 (default 1)",
        "--latency-ms": "the link's latency per message in ms, > 0 (default 10)",
        "--overlap-slowdown": "how much an overlapped transfer slows the compute it hides "
        "behind, a fraction >= 0 (default 0.189: 18.9%%, arXiv 2507.03114)",
    }
    for flag, text in link_help.items():
        parser.add_argument(flag, default=None, help=f"the modelled wall clock: {text}")
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="runs per algorithm (train.seed, +1, ...); default 1, and 3 for the studies",
    )
    parser.add_argument(
        "--sweep",
        default="all",
        choices=["all", "compression", "ablations", *STUDIES],
        help="all, compression, ablations: rows of algorithms; scaling, eager, bytes, orderings: "
        "studies",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a study at its smallest grid (studies only)"
    )
    parser.add_argument(
        "--rows",
        default=None,
        help="comma-separated row labels to run, of every sweep's rows, in their order "
        "(default: the --sweep's; not with --sweep compression or ablations)",
    )
    parser.add_argument(
        "--rerun",
        action="store_true",
        help="run every row again (default: reuse runs whose result matches their config hash)",
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value, for every run")
    args = parser.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds={args.seeds}: must be >= 1")
    if args.sweep in STUDIES:
        return _study(args, parser)
    if args.smoke:
        parser.error(f"--smoke: only with a study (--sweep {'|'.join(STUDIES)})")
    if args.rows is not None and args.sweep != "all":
        parser.error(f"--rows picks from every sweep's rows: not with --sweep {args.sweep}")
    link = _link(args, parser)
    args.seeds = args.seeds or 1
    out = Path(args.out or f"results/{args.preset}")
    try:
        study_run.check_out_dir(out, args.out, "summary.json")
    except ValueError as e:
        parser.error(str(e))
    typed = _keys(args.overrides)
    fixes = {  # a setting given on the command line replaces the preset's fix
        algorithm: [item for item in items if _key(item) not in typed]
        for algorithm, items in PRESET_FIXES.get(args.preset, {}).items()
    }
    try:  # the overrides on their own: none of them meets the sweep's own log.progress
        checks.unique(args.overrides)  # a setting typed twice: which one was meant?
        base = config_lib.override(config_lib.preset(args.preset), ["log.progress=false"])
        base = config_lib.override(base, args.overrides)
    except ValueError as e:
        print(f"co2jax compare: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    sweep = {
        "all": SWEEP,
        "compression": [e for e in SWEEP if e[0] in COMPRESSION],
        "ablations": ABLATIONS,
    }[args.sweep]
    if args.rows is not None:
        every = SWEEP + ABLATIONS
        wanted = [label.strip() for label in args.rows.split(",") if label.strip()]
        unknown = [label for label in wanted if label not in {e[0] for e in every}]
        if unknown or not wanted:
            labels = ", ".join(e[0] for e in every)
            parser.error(f"--rows: unknown row(s) {unknown or args.rows!r}; the rows: {labels}")
        twice = [label for i, label in enumerate(wanted) if label in wanted[:i]]
        if twice:
            parser.error(f"--rows={args.rows!r}: names {twice[0]!r} twice")
        sweep = [e for e in every if e[0] in wanted]
    for note in checks.notes(base):  # the settings every row shares
        print(f"warning: {note}", file=sys.stderr)
    if link.overlap_slowdown > 1:  # a percentage typed for the fraction?
        print(
            f"warning: --overlap-slowdown={args.overlap_slowdown!r} is a fraction: overlapped "
            f"compute is modelled {link.overlap_slowdown:.0%} slower (the default 0.189 is 18.9%)",
            file=sys.stderr,
        )
    print(f"co2jax compare: preset {args.preset}, {len(sweep)} rows, writing {out}/report.md")
    try:
        rows = run_sweep(
            base,
            out,
            link,
            sweep=sweep,
            seeds=args.seeds,
            rerun=args.rerun,
            fixes=fixes,
            command_line=args.overrides,
        )
    except SweepError as e:
        print(f"co2jax compare: error: nothing ran: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"co2jax compare: interrupted; partial report: {out / 'report.md'}", file=sys.stderr)
        return 130
    path = out / "report.md"
    print("\n".join(ln for ln in path.read_text().splitlines() if ln.startswith("|")))
    print(f"report: {path}")
    return exit_status(rows)


def _study(args, parser) -> int:  # --sweep scaling|eager|bytes|orderings (experiments/studies.py)
    sweeper = study_run.Sweeper(run_sweep, plan_sweep, Link, SweepError)
    return study_run.command(args, parser, sweeper, study_reports)


if __name__ == "__main__":
    sys.exit(main())
