r"""A run's directory and its life: one config per run directory, metrics and TensorBoard
writers that stay free of repeated steps on resume, and the ways a run stops (signals,
divergence).

- :func:`claim`: checks that a run directory (and checkpoint directory) may hold this run,
  before anything is written: one config owns a directory; ``resume`` needs the same config;
  ``overwrite`` deletes the old run.
- :class:`Writers`: ``metrics.jsonl`` and TensorBoard scalars (step: the round; the losses
  also against tokens), the config as TensorBoard hyperparameters; on resume
  :func:`kept_records` keeps the records up to the restored round (a torn last line is
  dropped) and the event files are written anew from them (:func:`rebuild_tensorboard`).
- :class:`Interrupted`, :class:`Diverged`: the ways a run stops (the signal handlers that
  set the flag are :mod:`experiments.interrupts`, importable before JAX).

Example:
  >>> import tempfile, json
  >>> from pathlib import Path
  >>> from experiments.rundir import kept_records
  >>> with tempfile.TemporaryDirectory() as d:
  ...     path = Path(d) / "metrics.jsonl"
  ...     _ = path.write_text('{"round": 1}\n{"round": 2}\n{"round": 3, "tok')
  ...     [r["round"] for r in kept_records(path, 1)]
  [1]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import numpy as np

from experiments import config as config_lib
from experiments.files import write_atomic

LOSSES = ("train_loss", "eval_loss")
"""The scalars also logged against tokens (``by_tokens/<name>``) and listed as the
TensorBoard HParams dashboard's metrics."""


def hparams(config: config_lib.Config) -> dict:
    """The run's settings as TensorBoard hyperparameters: every leaf of the config by its
    dotted name (``outer.algorithm``), None as ``"none"``."""
    return {
        name: ("none" if value is None else value)
        for name, _, value in config_lib.leaves(config)
        if value is None or isinstance(value, bool | int | float | str)
    }


class Writers:
    """``metrics.jsonl`` (one JSON record per round) and TensorBoard scalars.

    TensorBoard's step is the outer round (``tensorboard/``); the losses are logged a second
    time against tokens seen (``tensorboard/by_tokens/``, tags ``by_tokens/train_loss``, ...:
    a writer of its own). The config goes in as hyperparameters (the HParams dashboard,
    metrics :data:`LOSSES`); ``finish()`` ends the HParams session once the last round is
    logged. Every record is flushed to both when written, so a killed run's event files
    hold what its ``metrics.jsonl`` holds.

    ``metrics.jsonl`` is the run's record of truth: a resumed run (``resumed``: the records
    it keeps, :func:`kept_records`) writes its event files anew from them
    (:func:`rebuild_tensorboard`) before it logs its next round, so after any kill and resume
    the event files hold every round ``metrics.jsonl`` holds, once, whatever the killed
    process had flushed.
    """

    def __init__(
        self,
        out: Path,
        tensorboard: bool,
        resumed: list[dict] | None = None,
        hparam_dict: dict | None = None,
    ):
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = (out / "metrics.jsonl").open("a")
        self.tb, self.tb_tokens, self.session_end = None, None, None
        if not tensorboard:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # optional: pip install co2jax[experiments]
            return
        if resumed is not None:
            rebuild_tensorboard(out / "tensorboard", resumed, hparam_dict)
        # named to sort after a rebuilt file of the same second (TensorBoard reads in name order)
        self.tb = SummaryWriter(str(out / "tensorboard"), filename_suffix=".1")
        self.tb_tokens = SummaryWriter(str(out / "tensorboard" / "by_tokens"), filename_suffix=".1")
        if hparam_dict is not None:
            exp, start, self.session_end = _hparam_summaries(hparam_dict)
            if resumed is None:  # a rebuilt directory has them already
                self.tb.file_writer.add_summary(exp)
                self.tb.file_writer.add_summary(start)
                self.tb.flush()

    def write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            _log_scalars(self.tb, self.tb_tokens, record)
            self.tb.flush()
            self.tb_tokens.flush()

    def finish(self) -> None:
        """The run's last round is logged: end the HParams session."""
        if self.tb is not None and self.session_end is not None:
            self.tb.file_writer.add_summary(self.session_end)
            self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
            self.tb_tokens.close()


def _hparam_summaries(hparam_dict: dict) -> tuple:
    from tensorboardX.summary import hparams as hparam_summaries

    return hparam_summaries(hparam_dict, dict.fromkeys(LOSSES, 0.0))


def _log_scalars(tb, tb_tokens, record: dict) -> None:
    """One round's record as scalars: every number by the round, the losses also by tokens."""
    for key, value in record.items():
        if isinstance(value, int | float) and key != "round":
            tb.add_scalar(key, value, record["round"])
            if key in LOSSES:
                tb_tokens.add_scalar(f"by_tokens/{key}", value, record["tokens"])


def rebuild_tensorboard(directory: Path, records: list[dict], hparam_dict: dict | None) -> None:
    """Replaces ``directory``'s event files with ones written from ``records`` (and the
    hyperparameters' experiment and session start, when given): each round once.

    Written beside it (``<directory>.rebuild``), then swapped in by renames; a kill at any
    point leaves the old files or the new ones, and the next resume rebuilds again (a
    leftover ``.rebuild`` or ``.old`` directory is removed first)."""
    from tensorboardX import SummaryWriter

    fresh = directory.with_name(directory.name + ".rebuild")
    old = directory.with_name(directory.name + ".old")
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tb = SummaryWriter(str(fresh), filename_suffix=".0")
    tb_tokens = SummaryWriter(str(fresh / "by_tokens"), filename_suffix=".0")
    try:
        if hparam_dict is not None:
            exp, start, _ = _hparam_summaries(hparam_dict)
            tb.file_writer.add_summary(exp)
            tb.file_writer.add_summary(start)
        for record in records:
            _log_scalars(tb, tb_tokens, record)
    finally:
        tb.close()
        tb_tokens.close()
    for path in fresh.rglob("events.out.tfevents.*"):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    if directory.exists():
        os.replace(directory, old)
    os.replace(fresh, directory)
    shutil.rmtree(old, ignore_errors=True)


RUN_FILE = "run.json"
"""The run directory's identity (:func:`identity`), next to ``config.json``."""


class RunError(ValueError):
    """A run that cannot start as asked (its directory, its resume), raised before compute."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run at a round boundary (its checkpoint saved)."""

    def __init__(self, signum: int, rounds: int, saved: int | None):
        name = signal.Signals(signum).name
        at = f"checkpoint at round {saved}" if saved is not None else "no checkpoint"
        super().__init__(f"{name}: stopped after round {rounds} ({at})")
        self.signum, self.rounds, self.saved = signum, rounds, saved


class Diverged(RuntimeError):
    """The training loss went non-finite, or the outer guard skipped too many rounds."""


def diff(stored: dict, wanted: dict, prefix: str = "") -> list[str]:
    """The dotted names of the fields that differ between two config dicts."""
    out = []
    for key in sorted(set(stored) | set(wanted)):
        a, b = stored.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


TRAJECTORY = ("model", "data", "inner", "outer", "train.seed", "train.sync_every",
              "train.rounds", "mesh.replica")  # fmt: skip
"""The config fields that change a run's values (the layouts, logging, evaluation and
checkpointing do not)."""


def trajectory(cfg: config_lib.Config) -> dict:
    """The :data:`TRAJECTORY` fields of ``cfg``, as a dict of sections."""
    whole, out = json.loads(config_lib.to_json(cfg)), {}
    for name in TRAJECTORY:
        section, _, field = name.partition(".")
        if field:
            out.setdefault(section, {})[field] = whole[section][field]
        else:
            out[section] = whole[section]
    return out


def identity(cfg: config_lib.Config, run_id: str) -> dict:
    """What each checkpoint records of its run: ``run_id``, the trajectory fields and their
    SHA-256 (``digest``)."""
    fields = trajectory(cfg)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"run_id": run_id, "digest": digest, "trajectory": fields}


def run_id(out: Path, resume: bool) -> tuple[str, bool]:
    """``(id, known)``: the run directory's id (``run.json``) when resuming one that has it,
    else a new one (``known`` False: the checkpoint's run is adopted if it is the same)."""
    path = out / RUN_FILE
    if resume and path.exists():
        try:
            return str(json.loads(path.read_text())["run_id"]), True
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or foreign file: treated as absent
    return uuid.uuid4().hex[:12], False


def check_identity(
    stored: dict | None, mine: dict, known: bool, where: str, allow_change: bool
) -> dict:
    """The identity the resumed run carries on: refuses (:class:`RunError`, one line naming the
    differing fields) a checkpoint of another run, or of this run under changed trajectory
    fields, unless ``allow_change`` (a deliberate continuation: the run keeps its own id and
    says what changed). A checkpoint without an identity (an older one) is accepted."""
    if stored is None or not isinstance(stored, dict):
        return mine
    changed = diff(stored.get("trajectory", {}), mine["trajectory"])
    other = known and stored.get("run_id") != mine["run_id"]
    if not (changed or other):
        return {**mine, "run_id": stored.get("run_id", mine["run_id"])}
    fields = f"another config ({'; '.join(changed)})"
    if other:
        what = f"run {stored.get('run_id')}'s checkpoints, not this run's ({mine['run_id']})"
        what += f", written under {fields}" if changed else ""
    elif not known and stored.get("run_id"):  # a new run directory: the checkpoints' own run
        what = f"run {stored['run_id']}'s checkpoints, written under {fields}"
    else:
        what = f"checkpoints written under {fields}"
    if not allow_change:
        raise RunError(
            f"--resume: {where} holds {what}: pass --allow-config-change to continue them "
            "deliberately"
        )
    print(f"warning: --allow-config-change: {where} holds {what}; continuing", file=sys.stderr)
    return mine


RUN_FILES = ("config.json", RUN_FILE, "metrics.jsonl", "tensorboard", "result.json")
"""What a run directory holds (``result.json``: a sweep's row), beside its temporaries
(``.<name>.tmp``, ``tensorboard.rebuild``, ``tensorboard.old``) and a sweep row's
``checkpoints/``."""


def _not_a_runs(directory: Path, checkpoints: bool, ckpt: Path | None = None) -> list[str]:
    """The names in ``directory`` that no run writes there: a run directory's files
    (:data:`RUN_FILES`, and ``ckpt``, the run's checkpoint directory, when it lies there), or
    a checkpoint directory's orbax steps (``checkpoints``)."""
    if not directory.is_dir():
        return []
    foreign = []
    for p in sorted(directory.iterdir()):
        name = p.name
        if name.startswith(".") and name.endswith(".tmp"):
            continue  # the atomic writer's temporary
        if checkpoints:
            ours = p.is_dir() and (name.isdigit() or ".orbax-checkpoint-tmp" in name)
        else:
            ours = name in RUN_FILES or name in ("tensorboard.rebuild", "tensorboard.old")
            inside = ckpt is not None and p.absolute() == ckpt.absolute()
            ours = ours or ((inside or name == "checkpoints") and not _not_a_runs(p, True))
        if not ours:
            foreign.append(name)
    return foreign


def _holds(directory: Path, checkpoints: bool) -> str:
    """What a used run or checkpoint directory holds, for the message that refuses it."""
    if checkpoints:
        steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
        return f"checkpoints at rounds {steps}" if steps else "no checkpoint"
    metrics = directory / "metrics.jsonl"
    rounds = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rounds.append(int(json.loads(line)["round"]))
    if rounds:
        return f"last logged round: {rounds[-1]}"
    return "a run that logged no round"


def claim(
    cfg: config_lib.Config, out: Path, resume: bool, overwrite: bool, allow_change: bool = False
) -> None:
    """Checks that ``out`` (and the checkpoint dir) may hold this run, before anything is
    written: one config owns a run directory (``allow_change``: a resumed run may change
    it). ``overwrite`` deletes the old run, and only a run: a directory holding files no run
    writes (``checkpoint.dir=.`` beside a corpus, say) is refused, never deleted."""
    ckpt = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if resume and overwrite:
        raise RunError("--resume and --overwrite: choose one")
    if resume:
        if ckpt is None:
            raise RunError("--resume: checkpoint.dir is not set, so there is nothing to resume")
        stored = out / "config.json"
        if stored.exists() and not allow_change:
            wanted = json.loads(config_lib.to_json(cfg))
            changed = diff(json.loads(stored.read_text()), wanted)
            if changed:  # train.rounds too: the learning-rate schedule spans the rounds
                raise RunError(
                    f"--resume: {out} holds a run with another config ({'; '.join(changed)}):"
                    " pass --allow-config-change to continue it under this one"
                )
        return
    dirs = [(out, False)] + ([(ckpt, True)] if ckpt is not None else [])
    used = [(p, c) for p, c in dirs if p.is_dir() and any(p.iterdir())]
    for p, c in used:
        foreign = _not_a_runs(p, c, ckpt)
        if foreign:
            key = "checkpoint.dir" if c else "the run directory"
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise RunError(
                f"{key} {p} holds files that are not a run's ({shown}): choose another "
                f"{'checkpoint.dir' if c else 'log.dir or name'}"
            )
    if used and not overwrite:
        p, c = used[0]
        raise RunError(
            f"{p} already holds a run ({_holds(p, c)}): pass --resume to continue it or "
            "--overwrite to replace it"
        )
    for p, _ in used:  # --overwrite: the old run goes, before this one writes anything
        if p.exists():  # (a checkpoint directory inside the run directory went with it)
            shutil.rmtree(p)


def remove_run(path: Path) -> None:
    """Deletes the run directory ``path`` (a sweep's row it runs again), and only a run: a
    directory holding files no run writes is refused (:class:`RunError`), never deleted."""
    path = Path(path)
    if not path.exists():
        return
    foreign = [path.name] if not path.is_dir() else _not_a_runs(path, False)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise RunError(f"{path} holds files that are not a run's ({shown}): not deleting it")
    shutil.rmtree(path)


def discard_unstarted(out: Path) -> None:
    """Removes what a fresh run wrote into ``out`` when it ends before logging its first
    round (a failure or a stop during start-up), so that the same command runs again as it
    is. A run that logged a round keeps everything."""
    metrics = out / "metrics.jsonl"
    if metrics.exists() and metrics.read_text().strip():
        return
    for name in (*RUN_FILES, "tensorboard.rebuild", "tensorboard.old"):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()
    with contextlib.suppress(OSError):
        out.rmdir()  # only when nothing else is left in it


def check_finite(rounds: int, loss: np.ndarray) -> None:
    per_replica = loss.reshape(loss.shape[0], -1).mean(axis=1)
    if not np.isfinite(per_replica).any():
        raise Diverged(
            f"round {rounds}: the training loss is {per_replica[0]} on every replica; lower "
            "inner.learning_rate (or check the data)"
        )


def kept_records(path: Path, start: int) -> list[dict]:
    """Keeps the metrics of rounds <= ``start`` (a resumed run rewrites the later ones); a
    torn last line (a run killed while writing it) is dropped."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written line
        if record.get("round", 0) <= start:
            kept.append(record)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept
