"""Language-model pretraining with an outer-optimizer algorithm, on the round engine.

    python -m experiments.train --preset cpu-tiny outer.algorithm=co2 train.rounds=10

Builds the data streams, the flax.nnx transformer, the inner AdamW and the outer algorithm
from a :class:`experiments.config.Config`, runs ``train.rounds`` rounds of
:class:`co2jax.RoundTrainer`, and writes into ``log.dir/<name>/``: ``config.json`` (the
resolved config), ``metrics.jsonl`` (one record per round), TensorBoard event files, and orbax
checkpoints when ``checkpoint.dir`` is set (``--resume`` continues from the latest one; each
checkpoint holds the Grain data iterator's state, so a resumed run reads the same batches).
"""

from __future__ import annotations

# The command's first line: its SIGINT/SIGTERM handlers go in before JAX is imported (a Ctrl-C
# raised while JAX loads can be dropped in its garbage-collection callback: experiments.interrupts)
from experiments import interrupts

if __name__ == "__main__":
    interrupts.install_early()

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

import co2jax
from co2jax.algorithms import registry
from experiments import checkpoints as ckpt_lib
from experiments import checks, files, rundir
from experiments import config as config_lib
from experiments import inner as inner_lib
from experiments.programs import build_validated, device_origin, setup_devices, with_outer_lr
from experiments.rundir import Diverged, Interrupted, RunError

_consensus = jax.jit(co2jax.consensus_distance)  # 0 unless replicas keep their own anchors


class Result(NamedTuple):
    history: list[dict]  # one record per round run here (also in metrics.jsonl)
    state: Any  # the final co2jax.TrainState
    entropy_rate: float | None  # the data's entropy floor (nats/token), None for real text


def train(cfg: config_lib.Config, **options: Any) -> Result:
    """Validates ``cfg`` (:func:`experiments.checks.validate`: a
    :class:`~experiments.config.ConfigError` before anything is written) and runs it
    (:func:`train_validated`, which takes the same ``options``)."""
    return train_validated(checks.validate(cfg), **options)


def train_validated(
    cfg: config_lib.Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    out_dir: str | None = None,
    stop_after: int | None = None,
    progress: str | None = None,
    allow_config_change: bool = False,
    signals: interrupts.Signals | None = None,
) -> Result:
    """Runs ``cfg``, validated where it was loaded (:func:`experiments.checks.load`, or a
    sweep's plan); returns the per-round records and the final state.

    ``progress``: a label for a progress bar of the rounds that disappears when the run ends,
    shown on a terminal only, whatever ``log.progress`` says (a sweep's row: the bar inside
    the row). ``stop_after`` ends this invocation after that many rounds in total (as a job
    time limit would); a later ``resume=True`` run continues from the last checkpoint.
    Checkpoints are taken at round boundaries: a resumed run repeats the rounds after the
    last checkpoint and ends bitwise-identical to an uninterrupted one.

    Refused before anything is written (:class:`RunError`): a run directory or checkpoint
    directory holding another run (unless ``resume`` or ``overwrite``), ``resume`` without
    ``checkpoint.dir``, ``resume`` with a config that differs from the stored one in any field
    (``train.rounds`` too: the schedules span the run), ``resume`` of checkpoints another run
    wrote or this run wrote under other trajectory fields (each checkpoint records its run's id
    and those fields: :func:`experiments.rundir.identity`); ``allow_config_change`` lets a
    resumed run continue under a changed config deliberately. SIGINT/SIGTERM stop at the next
    round boundary, after a checkpoint (:class:`Interrupted`); a non-finite training loss
    on every replica, or ``train.max_skipped`` rounds in a row skipped by the outer guard,
    stop the run (:class:`Diverged`)."""
    out = Path(out_dir or os.path.join(cfg.log.dir, cfg.name))
    rundir.claim(cfg, out, resume, overwrite, allow_config_change)
    try:
        return _train_claimed(cfg, out, resume, stop_after, progress, allow_config_change, signals)
    except BaseException:  # a fresh run that logged no round leaves nothing to block a rerun
        if not resume:
            rundir.discard_unstarted(out)
        raise


def _train_claimed(
    cfg: config_lib.Config,
    out: Path,
    resume: bool,
    stop_after: int | None,
    progress: str | None,
    allow_config_change: bool,
    signals: interrupts.Signals | None,
) -> Result:
    """:func:`train_validated` once the run directory is claimed."""
    run_id, known = rundir.run_id(out, resume)
    me = rundir.identity(cfg, run_id)
    manager = (
        ckpt_lib.Checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep)
        if cfg.checkpoint.dir
        else None
    )
    where = f"checkpoint.dir={cfg.checkpoint.dir}"
    try:  # whose checkpoints these are, before anything is built or written
        if resume and manager is not None:
            newest = manager.newest_run()
            if newest is not None:
                me = rundir.check_identity(newest[1], me, known, where, allow_config_change)
            elif not manager.steps():
                print(f"--resume: {where} holds no checkpoint: round 0", file=sys.stderr)
        run = build_validated(cfg)
    except BaseException:
        if manager is not None:
            manager.close()
        raise
    trainer, streams, t = run.trainer, run.streams, cfg.train

    state, start = with_outer_lr(trainer.init(run.params), cfg), 0
    if resume and manager is not None and manager.steps():
        start, state = manager.restore(trainer.abstract_state(run.params))
        try:  # the checkpoint restored may be an older one than the newest
            me = rundir.check_identity(manager.run_of(start), me, known, where, allow_config_change)
        except RunError:
            manager.close()
            raise
        print(f"resumed from round {start} of {t.rounds} ({where})", file=sys.stderr)
    # the data: a Grain iterator, positioned where the checkpoint's left it (older checkpoints
    # hold none: their round is the position)
    tokens = streams.iterator(start)
    if start and manager is not None and manager.restore_data(start, tokens):
        if tokens.get_state().get("next_index") != start:
            tokens.close()
            manager.close()
            raise RunError(
                f"checkpoint step {start}: its data iterator is at "
                f"{tokens.get_state()}, not at round {start}; the checkpoint is not this run's"
            )
    out.mkdir(parents=True, exist_ok=True)
    files.write_atomic(out / "config.json", config_lib.to_json(cfg))
    files.write_atomic(out / rundir.RUN_FILE, json.dumps(me, indent=1))
    previous = rundir.kept_records(out / "metrics.jsonl", start)

    R, H, B, L = streams.shape[0], streams.shape[1], streams.shape[2], streams.shape[3] - 1
    tokens_per_round = R * H * B * L
    # TensorBoard steps are rounds; a resumed run writes its event files anew from the kept
    # records, so they hold each round metrics.jsonl holds, once
    writers = rundir.Writers(
        out, cfg.log.tensorboard, previous if resume else None, rundir.hparams(cfg)
    )
    if resume and start == t.rounds:  # finished: the rebuilt HParams session ends again
        writers.finish()
    history, bytes_total = [], (previous[-1]["bytes_total"] if previous else 0.0)
    bytes_slow_total = previous[-1].get("bytes_slow_total", 0.0) if previous else 0.0
    label, progress = progress, None
    if cfg.log.progress or label is not None:
        from tqdm import tqdm

        progress = tqdm(
            total=t.rounds,
            initial=start,
            desc=label or cfg.name,
            unit="round",
            leave=label is None,
            disable=None if label is not None else False,  # None: off unless a terminal
        )
    eval_fn, eval_batch = run.eval_fn
    every_step = registry.capabilities(cfg.outer.algorithm).every_step
    # the inner lr at each round's end, evaluated once in one program (op by op, a schedule
    # costs a dispatch, and a compile, per operation: more than a small model's round on CPU)
    inner_lrs = np.asarray(jax.jit(jax.vmap(run.schedule))(np.arange(1, t.rounds + 1) * H))
    last_skipped = cfg.outer.recorded(state.outer_state).get("skipped") or 0
    saved, skipped_run = (start or None), 0
    try:
        with signals or interrupts.Signals() as signals:
            end = t.rounds if stop_after is None else min(t.rounds, stop_after)
            if signals.signum is not None and start < end:  # during start-up: no round run
                raise rundir.Interrupted(signals.signum, start, saved)
            for k in range(start, end):
                began = time.perf_counter()
                # drawn in Grain's thread while the previous round computed
                state, metrics = trainer.round(state, next(tokens))
                metrics = jax.device_get(metrics)
                seconds = time.perf_counter() - began
                bytes_round = float(np.asarray(metrics.bytes_communicated)[0])
                bytes_inner = 0.0  # DDP, DeMo, SPARTA communicate in every inner step too
                if every_step:
                    bytes_inner = H * cfg.outer.step_bytes(run.params, R, H)
                bytes_round += bytes_inner
                bytes_total += bytes_round
                slow = cfg.outer.slow_link_bytes(run.params, R)  # None: every byte may
                bytes_slow = bytes_round if slow is None else slow  # cross the slow links
                bytes_slow_total += bytes_slow
                loss = np.asarray(metrics.loss)
                record = {
                    "round": k + 1,
                    "tokens": (k + 1) * tokens_per_round,
                    "train_loss": float(loss.mean()),
                    "train_loss_last": float(loss[:, -1].mean()),
                    "train_loss_per_replica": [float(x) for x in loss.mean(axis=1)],
                    "bytes_round": bytes_round,
                    "bytes_inner": bytes_inner,
                    "bytes_total": bytes_total,
                    "bytes_slow": bytes_slow,
                    "bytes_slow_total": bytes_slow_total,
                    "pseudo_gradient_norm": float(np.asarray(metrics.pseudo_gradient_norm).mean()),
                    "cosine_to_mean": float(np.asarray(metrics.cosine_to_mean).mean()),
                    "seconds": seconds,
                    "tokens_per_s": tokens_per_round / seconds,
                    "inner_lr": float(inner_lrs[k]),
                    # what the algorithm records of its state (these three: None where it
                    # has none of them)
                    **dict.fromkeys(("skipped", "clip_fraction", "penalty_scale")),
                    **cfg.outer.recorded(state.outer_state),
                    "collective": _collectives(trainer, state, every_step),
                    "overlapped": trainer.outer.overlapped,
                }
                last = k + 1 == t.rounds
                if last or (cfg.eval.every and (k + 1) % cfg.eval.every == 0):
                    at = inner_lib.evaluated_params(cfg.inner, state)
                    record["eval_loss"] = float(
                        np.asarray(jax.device_get(eval_fn(at, eval_batch))).mean()
                    )
                    # with the eval, not every round: a reduction of every parameter over the
                    # replica axis (the slow link) that the algorithm itself does not need
                    record["consensus_distance"] = float(_consensus(state.params))
                writers.write(record)
                if last:
                    writers.finish()
                history.append(record)
                if progress is not None:
                    progress.set_postfix(
                        loss=f"{record['train_loss_last']:.3f}",
                        tok_s=f"{record['tokens_per_s']:.0f}",
                    )
                    progress.update(1)
                rundir.check_finite(k + 1, loss)
                if record["skipped"] is not None:
                    skipped_run = skipped_run + 1 if record["skipped"] > last_skipped else 0
                    last_skipped = record["skipped"]
                    if skipped_run >= t.max_skipped:
                        raise rundir.Diverged(
                            f"round {k + 1}: the outer guard skipped {skipped_run} rounds in a "
                            "row (non-finite payloads); lower inner.learning_rate"
                        )
                due = cfg.checkpoint.every and (k + 1) % cfg.checkpoint.every == 0
                if manager is not None and (due or last or signals.signum is not None):
                    manager.save(k + 1, state, data=tokens, run=me)
                    saved = k + 1
                if signals.signum is not None and not last:
                    raise rundir.Interrupted(signals.signum, k + 1, saved)
    finally:
        tokens.close()
        writers.close()
        if progress is not None:
            progress.close()
        if manager is not None:
            manager.close()
    return Result(history, state, streams.entropy_rate)


def _help_algorithm(argv: list[str]) -> str:
    """The algorithm whose settings ``--help`` lists: the last ``outer.algorithm=`` typed."""
    typed = [
        a.split("=", 1)[1].strip()
        for a in argv
        if a.replace(" ", "").startswith("outer.algorithm=")
    ]
    known = [a for a in typed if a in registry.REGISTRY]
    return known[-1] if known else config_lib.DEFAULT_ALGORITHM


def _collectives(trainer, state, every_step: bool) -> str:
    """Where a round's exchanges happen: in the inner steps, in the outer transfers, or both
    (SPARTA-DiLoCo); an empty schedule with a local inner transform says so."""
    where = ["in the inner transform (every step)"] if every_step else []
    if trainer.transfers:
        kind = trainer.program(state).reducer_kind
        where.append(f"{kind} ({len(trainer.transfers)} per round)")
    return " and ".join(where) or "none"


def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.train [--preset P] [--config FILE] [flags] section.field=value``.

    The config (the preset, the file on top, the overrides on top of that) is validated once
    (:func:`experiments.checks.load`), then the mesh against the devices and the paths
    (:func:`experiments.checks.check_paths`), before anything is written or compiled. A
    refused config or run prints one line to stderr, ``error: <override>: <reason>`` with the
    override as typed, and exits with status 2 (``--debug``: raises it instead).
    ``--help outer.algorithm=NAME`` lists that algorithm's settings.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        description="co2jax pretraining run",
        epilog=config_lib.describe(_help_algorithm(argv)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        default="cpu-tiny",
        choices=sorted(config_lib.PRESETS),
        help="the config the overrides start from (default: cpu-tiny)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML or JSON config (--print-config writes one) on top of the preset; the "
        "overrides go on top of it",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue checkpoints written under another config or by another "
        "run (a deliberate fine-tune or extension)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in log.dir/<name> and checkpoint.dir",
    )
    parser.add_argument("--distributed", action="store_true", help="join a multi-host run first")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (JSON) and exit"
    )
    parser.add_argument(
        "--debug", action="store_true", help="raise a refused config or run with its traceback"
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value (the fields below)")
    args = parser.parse_args(argv)
    with interrupts.command_signals() as signals:  # a signal during start-up is kept
        _run_command(args, signals)


def _run_command(args: argparse.Namespace, signals: interrupts.Signals) -> None:
    """:func:`main` after its arguments are parsed, with the signal handlers installed."""
    try:
        cfg = checks.load(args.preset, args.overrides, args.config)  # the one validation
        for note in checks.notes(cfg):
            print(f"warning: {note}", file=sys.stderr)
        if args.print_config:
            print(config_lib.to_json(cfg))
            return
        checks.check_paths(cfg, args.config)
        if args.distributed:
            co2jax.distributed.initialize()
        setup_devices(cfg)
        checks.check_devices(cfg, jax.device_count(), device_origin())
        if args.allow_config_change and not args.resume:
            raise RunError("--allow-config-change: only with --resume")
        history = train_validated(
            cfg,
            resume=args.resume,
            overwrite=args.overwrite,
            allow_config_change=args.allow_config_change,
            signals=signals,
        ).history
    except (config_lib.ConfigError, RunError) as e:
        if args.debug:
            raise
        line = e.typed(args.overrides) if isinstance(e, config_lib.ConfigError) else str(e)
        print(f"error: {' '.join(line.splitlines())}", file=sys.stderr)
        raise SystemExit(2) from None
    except Interrupted as e:
        if args.debug:
            raise
        again = ["python -m experiments.train", f"--preset {args.preset}", "--resume"]
        if args.config:
            again.append(f"--config {shlex.quote(args.config)}")
        again += [shlex.quote(o) for o in args.overrides]
        if e.saved is None and e.rounds == 0:
            print(f"{e}; nothing was trained: run the same command again", file=sys.stderr)
        elif e.saved is None:
            print(f"{e} (checkpoint.dir is not set: nothing to resume)", file=sys.stderr)
        else:
            print(f"{e}; resume with:\n  {' '.join(again)}", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    except (Diverged, ckpt_lib.CheckpointError) as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        raise SystemExit(1) from None
    if history:
        last = history[-1]
        eval_loss = last.get("eval_loss", float("nan"))
        print(f"{cfg.name}: round {last['round']}, eval loss {eval_loss:.4f}")
    else:  # resumed at its last round: say so rather than print nothing
        print(f"{cfg.name}: already finished ({cfg.train.rounds} rounds); nothing to run")


if __name__ == "__main__":
    main()
