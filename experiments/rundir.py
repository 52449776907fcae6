r"""A run's directory and its life: one config per run directory, metrics and TensorBoard
writers that stay free of repeated steps on resume, and the ways a run stops (signals,
divergence).

- :func:`claim`: checks that a run directory (and checkpoint directory) may hold this run,
  before anything is written: one config owns a directory; ``resume`` needs the same config;
  ``overwrite`` deletes the old run.
- :class:`Writers`: ``metrics.jsonl`` and TensorBoard scalars (step: the round; the losses
  also against tokens), the config as TensorBoard hyperparameters; on resume
  :func:`kept_records` keeps the records up to the restored round (a torn last line is
  dropped) and TensorBoard's ``purge_step`` hides the scalars logged after it.
- :class:`Signals`: SIGINT/SIGTERM set a flag the training loop reads at a round boundary.

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

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from experiments import config as config_lib

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
    a writer of its own, since TensorBoard hides a resumed run's overlap by step, per
    writer). A fresh run writes its config as hyperparameters (the HParams dashboard, metrics
    :data:`LOSSES`); a resumed one (``resumed_at``: the restored round and its tokens) opens
    its writers with ``purge_step`` just past them, so TensorBoard hides what the interrupted
    run logged after its checkpoint (the resumed run logs it again). ``finish()`` ends the
    HParams session once the last round is logged.
    """

    def __init__(
        self,
        out: Path,
        tensorboard: bool,
        resumed_at: tuple[int, int] | None = None,
        hparam_dict: dict | None = None,
    ):
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = (out / "metrics.jsonl").open("a")
        self.tb, self.tb_tokens, self.session_end = None, None, None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
                from tensorboardX.summary import hparams as hparam_summaries
            except ImportError:  # optional: pip install co2jax[experiments]
                return
            purge = (None, None) if resumed_at is None else (resumed_at[0] + 1, resumed_at[1] + 1)
            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=purge[0])
            self.tb_tokens = SummaryWriter(
                str(out / "tensorboard" / "by_tokens"), purge_step=purge[1]
            )
            if hparam_dict is not None:
                exp, start, self.session_end = hparam_summaries(
                    hparam_dict, dict.fromkeys(LOSSES, 0.0)
                )
                if resumed_at is None:
                    self.tb.file_writer.add_summary(exp)
                    self.tb.file_writer.add_summary(start)

    def write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "round":
                    self.tb.add_scalar(key, value, record["round"])
                    if key in LOSSES:
                        self.tb_tokens.add_scalar(f"by_tokens/{key}", value, record["tokens"])

    def finish(self) -> None:
        """The run's last round is logged: end the HParams session."""
        if self.tb is not None and self.session_end is not None:
            self.tb.file_writer.add_summary(self.session_end)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
            self.tb_tokens.close()


RUN_FILE = "run.json"
"""The run directory's identity (:func:`identity`), next to ``config.json``."""


def replace_synced(tmp: Path, path: Path) -> None:
    """Flushes ``tmp`` to the disk, then renames it over ``path``: a kill at any point leaves
    the old file or the new one, whole."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Writes ``data`` to a temporary sibling and :func:`replace_synced` it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    replace_synced(tmp, path)


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
    else:
        what = f"checkpoints written under {fields}"
    if not allow_change:
        raise RunError(
            f"--resume: {where} holds {what}: pass --allow-config-change to continue them "
            "deliberately"
        )
    print(f"warning: --allow-config-change: {where} holds {what}; continuing", file=sys.stderr)
    return mine


def claim(
    cfg: config_lib.Config, out: Path, resume: bool, overwrite: bool, allow_change: bool = False
) -> None:
    """Checks that ``out`` (and the checkpoint dir) may hold this run, before anything is
    written: one config owns a run directory (``allow_change``: a resumed run may change
    it)."""
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
    used = [p for p in (out, ckpt) if p is not None and p.exists() and any(p.iterdir())]
    if used and not overwrite:
        raise RunError(
            f"{used[0]} already holds a run: pass --resume to continue it or --overwrite to "
            "replace it"
        )
    for p in used:  # --overwrite: the old run goes, before this one writes anything
        shutil.rmtree(p)


class Signals:
    """SIGINT/SIGTERM set a flag the loop reads at the next round boundary (a second one
    interrupts at once); handlers are installed only in the main thread. Entered again while
    installed (the command installs them on its first line, the run enters them again), it
    keeps the flag: a signal during start-up stops the run at its first round boundary."""

    def __init__(self):
        self.signum, self._old, self._depth = None, {}, 0

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this round", file=sys.stderr)

    def __enter__(self):
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


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
