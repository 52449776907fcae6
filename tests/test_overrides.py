"""Bad settings on the command line: one line on stderr naming the override, status 2, nothing
written, nothing compiled.

The fuzz list is generated per field (for every numeric field: its out-of-range values, nan and
inf for floats, a wrong type; for every string choice: a wrong name; malformed syntax; unknown
fields; settings the run would ignore; cross-field rules). Each case runs the CLI entry
in-process (``experiments.train.main``) with the run and checkpoint directories in a temporary
directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import checks, train
from experiments import config as config_lib

GiB = 1 << 30
DEADLINE_S = 30  # a refusal comes before anything compiles: well under this

# (field, bad values) for every numeric field; each is refused on the micro preset
NUMERIC = {
    "model.d_model": ["0", "-1"],
    "model.n_layers": ["0", "-1"],
    "model.n_heads": ["0", "3"],  # micro's d_model is 32
    "model.d_ff": ["0", "-1"],
    "data.vocab_size": ["0", "1", "-1"],
    "data.branching": ["0", "1", "1000"],  # micro's vocab_size is 32
    "data.max_bytes": ["0", "-1"],
    "data.batch": ["0", "-1", "3", str(10**12)],  # 3: not a multiple of mesh.data = 2
    "data.seq_len": ["0", "-1", "99999999", str(10**12)],
    "data.seed": ["-1", str(2**63)],
    "mesh.replica": ["0", "-1", "-2", "3"],
    "mesh.data": ["0", "-2", "3"],
    "mesh.model": ["0", "-2", "2"],
    "inner.learning_rate": ["0", "-1", "nan", "inf", "-inf"],
    "inner.weight_decay": ["-1", "nan", "inf"],
    "inner.b1": ["1.5", "1", "-0.1", "nan"],
    "inner.b2": ["-1", "1.0", "inf"],
    "inner.warmup_steps": ["-5", "-1"],
    "inner.gpa_mu_x": ["0.9"],  # ignored unless inner.optimizer=gpa
    "train.rounds": ["0", "-1", str(10**10)],
    "train.sync_every": ["0", "-1", "100000000", str(10**12)],
    "train.seed": ["-1", str(2**63)],
    "eval.every": ["-1"],
    "eval.batch": ["0", "-1", str(10**12)],
    "checkpoint.every": ["0", "-1"],
    "checkpoint.keep": ["0", "-1"],
    "outer.learning_rate": ["0", "-1", "nan", "inf"],  # the default algorithm's (diloco)
    "outer.momentum": ["1", "-0.5", "nan"],
    "outer.lr_warmup": ["-1"],
    "outer.lr_final": ["1.5", "-0.1"],
    "outer.momentum_decay": ["-1", "3"],  # micro runs 2 rounds
    "outer.momentum_restart": ["-1"],
    "outer.beta2": ["1", "-0.1"],
}
FRAGMENTED = {a: ["outer.tau=0"] for a in ("streaming_diloco", "cocodc")}  # micro: H // P = 1
# (algorithm, field): bad values of the numeric settings only some algorithms have
OUTER_NUMERIC = {
    ("streaming_diloco", "fragments"): ["0"],
    ("streaming_diloco", "alpha"): ["1.5", "-0.1"],
    ("delayed_diloco", "delay"): ["-1", "2"],  # micro runs 2 rounds
    ("eager_diloco", "delay"): ["0"],
    ("co2", "clip_threshold"): ["nan", "inf"],
    ("co2", "gap_decay"): ["1"],
    ("noloco", "group_size"): ["0", "3"],  # 3 does not divide mesh.replica = 4
    ("noloco", "momentum"): ["1"],
    ("hierarchical_diloco", "regions"): ["0", "3"],  # 3 does not divide mesh.replica = 4
    ("hierarchical_diloco", "global_every"): ["0"],
    ("hierarchical_diloco", "alpha"): ["0", "1.5"],
    ("hierarchical_diloco", "global_momentum"): ["1"],
    ("dct_diloco", "topk"): ["0"],
    ("dct_diloco", "dct_chunk"): ["0"],
    ("demo", "momentum"): ["1", "-0.5"],
    ("diloco_x", "rank"): ["0"],
    ("cocodc", "hessian_scale"): ["-1"],
    ("sparseloco", "decay"): ["-1"],
    ("slowmo", "learning_rate"): ["0"],
}
WRONG_TYPE = {
    "int": ["abc", "1.5", "1e3"],
    "float": ["abc"],
    "bool": ["maybe", "2"],
}
CHOICE = [  # the string fields with a fixed set of values (outer: of some algorithm)
    "model.preset",
    "model.dtype",
    "data.kind",
    "data.token_dtype",
    "inner.schedule",
    "inner.optimizer",
    "outer.algorithm",
    "outer.penalty",
    "outer.mode",
    "outer.implementation",
    "outer.compression",
    "outer.collective",
    "outer.optimizer",
    "outer.lr_schedule",
    "outer.quantizer",
    "outer.average",
    "outer.correction",
    "outer.factors",
    "outer.selector",
    "outer.feedback_scale",
    "outer.muon_scale",
]
CO2 = ["outer.algorithm=co2"]
# (overrides, the key the error must name)
CROSS = [
    (["outer.error_feedback=true"], "outer.error_feedback"),
    (["data.token_dtype=uint32"], "data.token_dtype"),
    (["data.path=/tmp/x.txt"], "data.path"),
    (["outer.algorithm=co2", "outer.delay=3"], "outer.delay"),
    (["outer.algorithm=delayed_diloco", "outer.delay=100"], "outer.delay"),
    (["outer.algorithm=eager_diloco", "outer.delay=2"], "outer.delay"),
    (["outer.algorithm=delayed_diloco", "outer.delay=0"], "outer.delay"),
    (["outer.algorithm=sparseloco", "outer.topk=0"], "outer.topk"),
    (["outer.algorithm=sparseloco", "outer.topk=30"], "outer.topk"),
    (["outer.algorithm=sparseloco", "outer.topk=64", "outer.chunk=32"], "outer.topk"),
    (["outer.algorithm=sparseloco", "outer.chunk=0"], "outer.chunk"),
    (["outer.algorithm=sparseloco", "outer.chunk=70000"], "outer.chunk"),
    (["outer.algorithm=sparseloco", "outer.decay=1.5"], "outer.decay"),
    ([*CO2, "outer.penalty=constant", "outer.penalty_lambda=-1"], "outer.penalty_lambda"),
    ([*CO2, "outer.penalty=constant", "outer.penalty_lambda=0"], "outer.penalty_lambda"),
    ([*CO2, "outer.penalty=gap_aware", "outer.gap_decay=2"], "outer.gap_decay"),
    ([*CO2, "outer.penalty=gap_aware", "outer.gap_decay=-1"], "outer.gap_decay"),
    ([*CO2, "outer.clip_threshold=0"], "outer.clip_threshold"),
    ([*CO2, "outer.clip_threshold=-1"], "outer.clip_threshold"),
    ([*CO2, "outer.mode=reference_code", "outer.clip_threshold=0.1"], "outer.clip_threshold"),
    ([*CO2, "outer.mode=reference_code", "outer.penalty=gap_aware"], "outer.penalty"),
    (["outer.penalty=constant"], "outer.penalty"),
    (["outer.penalty_lambda=2"], "outer.penalty_lambda"),
    (["outer.topk=16"], "outer.topk"),
    (["outer.tau=0"], "outer.tau"),
    (["outer.collective=two_step"], "outer.collective"),
    (["outer.compression=int8", "outer.collective=ring"], "outer.collective"),
    (["outer.algorithm=co2", "outer.compression=int8"], "outer.compression"),
    (["outer.algorithm=streaming_diloco", "outer.tau=1"], "outer.tau"),  # H // P = 1
    (["outer.algorithm=streaming_diloco", "outer.tau=-1"], "outer.tau"),
    (["outer.algorithm=streaming_diloco", "outer.tau=0", "outer.alpha=2"], "outer.alpha"),
    (["outer.algorithm=streaming_diloco", "outer.tau=0", "outer.fragments=3",
      "train.sync_every=6"], "outer.fragments"),  # micro has 2 blocks
    (["mesh.data=-1", "mesh.model=-1"], "mesh.model"),
    (["name=../../x"], "name"),
    (["name=a/b"], "name"),
    (["name=.."], "name"),
    (["name="], "name"),
    (["log.dir="], "log.dir"),
    (["checkpoint.dir="], "checkpoint.dir"),
    (["data.kind=text"], "data.path"),
    (["data.kind=tokens", "data.path=/nonexistent/tokens.bin"], "data.path"),
    (["data.kind=stdlib"], "data.vocab_size"),  # micro's 32 < 256 bytes
]  # fmt: skip
MALFORMED = [
    "noequals",
    "a.b.c=1",
    "outer.lr=1",
    "bogus=1",
    "model=tiny",
    "outer.learning_rate.x=1",
    "=1",
    ".x=1",
    "outer.=1",
    "train.rounds=",
    "train.rounds=0x10",
    "outer.clip_threshold=nonee",
]


leaves = config_lib.leaves  # (dotted name, field, default) of every field


def _configs() -> dict[str, config_lib.Config]:
    """The default config with each registered algorithm's settings as its outer section."""
    base = config_lib.Config()
    return {a: config_lib.with_algorithm(base, a) for a in config_lib.ALGORITHMS}


def _owner(key: str) -> list[str]:
    """``outer.algorithm=<the first algorithm with it>`` for an outer field the default
    algorithm lacks, else nothing."""
    keys = {a: [k for k, _, _ in leaves(c)] for a, c in _configs().items()}
    if not key.startswith("outer.") or key in keys[config_lib.DEFAULT_ALGORITHM]:
        return []
    return [f"outer.algorithm={next(a for a, names in keys.items() if key in names)}"]


def _cases() -> list[tuple[list[str], str]]:
    cases = [([f"{key}={v}"], key) for key, values in NUMERIC.items() for v in values]
    cases += [
        ([f"outer.algorithm={a}", *FRAGMENTED.get(a, []), f"outer.{name}={v}"], f"outer.{name}")
        for (a, name), values in OUTER_NUMERIC.items()
        for v in values
    ]
    seen = set()
    for algorithm, config in _configs().items():  # every field of every algorithm
        for key, f, _ in leaves(config):
            if key in seen or key == "outer.algorithm":
                continue
            seen.add(key)
            pick = [f"outer.algorithm={algorithm}"] if key.startswith("outer.") else []
            for v in WRONG_TYPE.get(f.type.split(" |")[0], []):
                cases.append(([*pick, f"{key}={v}"], key))
    cases += [([*_owner(key), f"{key}=bogus"], key) for key in CHOICE]
    cases += CROSS + UNDECLARED
    cases += [([item], item.split("=", 1)[0]) for item in MALFORMED]
    return cases


def _undeclared() -> list[tuple[list[str], str]]:
    """For every algorithm, a setting another algorithm has and it does not: refused by
    construction (its settings class has no such field)."""
    configs = _configs()
    names = {a: {k for k, _, _ in leaves(c)} for a, c in configs.items()}
    everything = set().union(*names.values())
    out = []
    for a in configs:
        key = min(everything - names[a])
        out.append(([f"outer.algorithm={a}", f"{key}=1"], key))
    return out


UNDECLARED = _undeclared()


CASES = _cases()


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


class _Deadline(BaseException):
    """Not an ``Exception``: no ``except Exception`` in the training loop swallows it."""


@pytest.fixture
def deadline():
    """Fails a case that is not refused within DEADLINE_S (it would be training), and again
    every second after, should the first be swallowed."""

    def expire(signum, frame):
        raise _Deadline(f"not refused within {DEADLINE_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def host(monkeypatch):
    """A 16 GiB host, whatever this machine has (``raising=False``: before the estimate)."""
    monkeypatch.setattr(checks, "host_memory", lambda: 16 * GiB, raising=False)


def _argv(tmp_path: Path, *overrides: str) -> list[str]:
    root = tmp_path / "a" / "b"  # name=../../x lands in tmp_path/a/x: still seen
    return [
        "--preset",
        "micro",
        f"log.dir={root / 'logs'}",
        f"checkpoint.dir={root / 'ckpt'}",
        "log.tensorboard=false",
        "log.progress=false",
        *overrides,
    ]


def test_fuzz_list_is_large():
    assert len(CASES) >= 150
    assert len({tuple(c) for c, _ in CASES}) == len(CASES)
    assert set(CHOICE) == set(config_lib.CHOICES)


@pytest.mark.parametrize(
    "overrides, key", CASES, ids=[" ".join(c) for c, _ in CASES]
)  # fmt: skip
def test_bad_override_is_one_clean_line(overrides, key, tmp_path, capsys, deadline, host):
    before = _files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        train.main(_argv(tmp_path, *overrides))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0] and "Traceback" not in err, err
    assert _files(tmp_path) == before


def test_error_names_the_override_as_typed(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(_argv(tmp_path, "outer.algorithm=sparseloco", "outer.topk=0"))
    assert capsys.readouterr().err == "error: outer.topk=0: must be in [1, 4096]\n"
    with pytest.raises(SystemExit):
        train.main(_argv(tmp_path, "inner.b2 = -1"))
    assert capsys.readouterr().err == "error: inner.b2 = -1: must be in [0, 1)\n"


def test_debug_raises_the_error(tmp_path):
    with pytest.raises(config_lib.ConfigError, match=r"checkpoint\.every=0: must be >= 1"):
        train.main(["--debug", *_argv(tmp_path, "checkpoint.every=0")])
    assert not _files(tmp_path)


def test_print_config_prints_the_resolved_config(tmp_path, capsys):
    argv = _argv(tmp_path, "outer.algorithm=co2", "train.rounds=3")
    assert train.main(["--print-config", *argv]) is None
    printed = json.loads(capsys.readouterr().out)
    expected = config_lib.override(config_lib.preset("micro"), argv[2:])
    assert config_lib.from_dict(printed) == expected and printed["train"]["rounds"] == 3
    assert not _files(tmp_path)


@pytest.mark.parametrize("algorithm", [None, *config_lib.ALGORITHMS])
def test_help_lists_every_field_with_type_default_and_description(algorithm, capsys):
    """``--help`` (``--help outer.algorithm=X``): every field of the config with ``X``'s
    settings as its outer section, with its type, default and description, and under
    ``outer`` no setting ``X`` does not have."""
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help", *([f"outer.algorithm={algorithm}"] if algorithm else [])])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    config = _configs()[algorithm or config_lib.DEFAULT_ALGORITHM]
    for key, f, default in leaves(config):
        line = next((s for s in out.splitlines() if s.split()[:1] == [key]), None)
        assert line is not None, key
        assert f.type in line and repr(default) in line, line
        assert f.metadata["help"] and f.metadata["help"] in line, line
    listed = {s.split()[0] for s in out.splitlines() if s.strip().startswith("outer.")}
    assert listed == {k for k, _, _ in leaves(config) if k.startswith("outer.")}
    assert "--print-config" in out and "--debug" in out and "--config" in out


def test_cli_subprocess_error_is_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = [sys.executable, "-m", "experiments.train", *_argv(tmp_path, "eval.every=-1")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: eval.every=-1: must be >= 0 (rounds; 0: after the last round only)"
    ]
    assert not _files(tmp_path)


# ---------------------------------------------------------------------------------------------
# validate(), for the sweep and the library callers


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["eval.every=0"],
        ["inner.warmup_steps=0", "inner.weight_decay=0", "inner.b1=0"],
        ["outer.algorithm=delayed_diloco", "outer.delay=1"],
        ["outer.algorithm=eager_diloco"],
        ["outer.algorithm=co2", "outer.penalty=constant", "outer.penalty_lambda=2"],
        ["outer.algorithm=co2", "outer.penalty=gap_aware", "outer.gap_decay=0.5"],
        ["outer.algorithm=co2", "outer.mode=reference_code", "outer.penalty=constant"],
        ["outer.algorithm=sparseloco", "outer.topk=4", "outer.chunk=8", "outer.decay=1"],
        ["outer.algorithm=streaming_diloco", "outer.tau=0", "outer.alpha=0"],
        ["outer.compression=int8", "outer.collective=two_step", "outer.error_feedback=true"],
        ["data.kind=tokens", "data.path=/data/tokens.bin", "data.token_dtype=uint32"],
        ["data.kind=stdlib", "data.vocab_size=256"],
        ["mesh.data=-1"],
        ["mesh.model=-1"],
        ["name=my-run_1.2", "checkpoint.dir=none"],
        ["outer.algorithm=co2", "outer.clip_threshold=none", "outer.clip_threshold=0.5"],
        ["outer.learning_rate=0.5", "outer.algorithm=noloco", "outer.group_size=4"],
        ["outer.algorithm=dct_diloco", "outer.topk=3", "outer.dct_chunk=7"],
        ["outer.algorithm=diloco_x", "outer.rank=2", "outer.factors=bf16"],
        ["model.n_heads=4", "model.d_model=64"],
    ],
)
def test_valid_configs_pass(overrides):
    cfg = config_lib.override(config_lib.preset("micro"), overrides)
    assert checks.validate(cfg, 8) is cfg


def test_every_sweep_row_validates():
    from experiments import sweep_rows

    base = config_lib.preset("cpu-tiny")
    for _, overrides in sweep_rows.SWEEP:
        checks.validate(config_lib.override(base, overrides), 8)


def test_load_validates():
    assert checks.load("micro", ["train.rounds=3"]).train.rounds == 3
    with pytest.raises(config_lib.ConfigError, match=r"^checkpoint\.keep=0: must be >= 1$"):
        checks.load("micro", ["checkpoint.keep=0"])


def test_config_error_is_a_value_error_with_the_key():
    with pytest.raises(ValueError) as e:
        checks.load("micro", ["outer.algorithm=co2", "outer.penalty=constant",
                                  "outer.penalty_lambda=-1"])  # fmt: skip
    assert isinstance(e.value, config_lib.ConfigError) and e.value.key == "outer.penalty_lambda"
    assert str(e.value) == "outer.penalty_lambda=-1.0: must be > 0"
    assert e.value.typed(["outer.penalty_lambda=-1"]) == "outer.penalty_lambda=-1: must be > 0"


def test_validate_checks_types_of_a_config_built_in_code():
    cfg = config_lib.preset("micro")
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, rounds="3"))
    with pytest.raises(config_lib.ConfigError, match=r"^train\.rounds='3': expected int$"):
        checks.validate(bad)
    inf = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, learning_rate=1e999))
    with pytest.raises(config_lib.ConfigError, match=r"^outer\.learning_rate=inf: must be"):
        checks.validate(inf)


def test_validate_refuses_an_outer_section_that_is_not_settings():
    cfg = dataclasses.replace(config_lib.preset("micro"), outer={"algorithm": "co2"})
    with pytest.raises(config_lib.ConfigError, match=r"^outer='dict': must be an algorithm's"):
        checks.validate(cfg)


def test_memory_estimate(monkeypatch):
    cfg = config_lib.preset("micro")  # R 4, H 2, B 4, L + 1 17, eval 8
    assert checks.data_bytes(cfg) == 4 * 4 * 2 * 4 * 17 + 16 * 2 * 4 * 17 + 20 * 8 * 17
    assert checks.host_memory() > 0
    monkeypatch.setattr(checks, "host_memory", lambda: 4096)
    with pytest.raises(config_lib.ConfigError, match=r"data buffers need .*mesh\.replica=4"):
        checks.validate(cfg)


def test_check_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = config_lib.override(config_lib.preset("micro"), [f"log.dir={tmp_path / 'file'}"])
    with pytest.raises(config_lib.ConfigError, match=r"^log\.dir=.*is a file"):
        checks.check_paths(cfg)
    cfg = config_lib.override(cfg, [f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path}/c"])
    assert checks.check_paths(cfg) is cfg
    tokens = config_lib.override(cfg, ["data.kind=tokens", f"data.path={tmp_path / 'no.bin'}"])
    with pytest.raises(config_lib.ConfigError, match=r"^data\.path=.*is not a file"):
        checks.check_paths(tokens)


# ---------------------------------------------------------------------------------------------
# --config FILE, the algorithm's settings as the outer section, one validation a run


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_print_config_round_trips_through_a_config_file(suffix, tmp_path, capsys):
    import yaml

    argv = _argv(tmp_path, "outer.algorithm=co2", "outer.clip_threshold=0.5", "train.rounds=3")
    train.main(["--print-config", *argv])
    printed = capsys.readouterr().out
    path = tmp_path / f"run{suffix}"
    tree = json.loads(printed)
    path.write_text(printed if suffix == ".json" else yaml.safe_dump(tree))
    # the file sets every field: the preset under it does not show through
    train.main(["--print-config", "--preset", "cpu-tiny", "--config", str(path)])
    assert capsys.readouterr().out == printed
    train.main(
        ["--print-config", "--config", str(path), "train.rounds=5", "outer.penalty=constant"]
    )
    again = json.loads(capsys.readouterr().out)
    assert again["train"]["rounds"] == 5 and again["outer"]["penalty"] == "constant"
    assert again["outer"]["clip_threshold"] == 0.5 and again["outer"]["algorithm"] == "co2"
    assert not _files(tmp_path) - {path}


def test_a_partial_config_file_goes_on_the_preset(tmp_path, capsys):
    path = tmp_path / "sparse.yaml"
    path.write_text(
        "outer:\n  algorithm: sparseloco\n  topk: 8\n  chunk: 64\ntrain:\n  rounds: 4\n"
    )
    train.main(["--print-config", "--preset", "micro", "--config", str(path)])
    tree = json.loads(capsys.readouterr().out)
    assert tree["outer"]["algorithm"] == "sparseloco" and tree["outer"]["topk"] == 8
    assert tree["train"]["rounds"] == 4 and tree["model"]["d_model"] == 32  # micro's


@pytest.mark.parametrize(
    "text, expected",
    [
        ("outer:\n  delay: 2\n", "outer.delay: diloco has no such setting (a setting of"),
        ("outer:\n  algorithm: co2\n  clip_threshold: -1\n", "outer.clip_threshold=-1.0: must"),
        ("train:\n  rounds: three\n", "train.rounds='three': expected int"),
        ("train: [1, 2\n", "--config="),
        ("- 1\n- 2\n", "must be a mapping"),
    ],
)
def test_a_bad_config_file_is_one_line(text, expected, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        train.main([*_argv(tmp_path, "--config", str(path))])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert expected in err and "Traceback" not in err, err
    assert _files(tmp_path) == {path}


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main([*_argv(tmp_path, "--config", str(tmp_path / "no.yaml"))])
    assert capsys.readouterr().err.startswith("error: --config=")


def test_the_algorithm_is_chosen_first_and_keeps_the_settings_it_shares():
    micro = config_lib.preset("micro")
    a = config_lib.override(micro, ["outer.learning_rate=0.5", "outer.algorithm=co2"])
    b = config_lib.override(micro, ["outer.algorithm=co2", "outer.learning_rate=0.5"])
    assert a == b and a.outer.learning_rate == 0.5 and type(a.outer).__name__ == "CO2Settings"
    # a setting the new algorithm lacks is left behind with the old one
    c = config_lib.override(micro, ["outer.compression=int8"])
    assert not hasattr(config_lib.override(c, ["outer.algorithm=co2"]).outer, "compression")
    # streaming DiLoCo keeps DiLoCo's outer step and compression
    d = config_lib.override(c, ["outer.algorithm=streaming_diloco", "outer.tau=0"])
    assert d.outer.compression == "int8" and d.outer.tau == 0


def test_one_run_validates_its_config_once(tmp_path, monkeypatch, capsys):
    """One CLI run: the config is validated once where it is loaded, the outer algorithm's
    checks (and its outer learning rate's) run once; nothing after re-validates."""
    import collections

    from co2jax.algorithms import settings

    calls = collections.Counter()

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(checks, "validate", counted("config", checks.validate))
    monkeypatch.setattr(settings.Settings, "validate", counted("outer", settings.Settings.validate))
    check = counted("learning_rate", settings.LearningRate.check)
    monkeypatch.setattr(settings.LearningRate, "check", check)
    train.main(_argv(tmp_path, "outer.algorithm=co2", "train.rounds=1", "eval.every=0"))
    assert "eval loss" in capsys.readouterr().out
    assert calls == {"config": 1, "outer": 1, "learning_rate": 1}
