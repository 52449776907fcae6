"""Files misused: an output that is an input, a run that fails half-way, files that are not
text, a token file read with the wrong dtype. Each is refused (or warned about) in one line,
before anything is written, and no input is ever changed: every test compares a digest of
every file in its folder before and after, and lists what was written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import data, sources, train
from experiments import tokenize_corpus as tc

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. " * 30


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (hidden ones too) and what it holds: a file's sha256, a
    link's target, or 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[key] = "dir"
        elif p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[key] = "special"
    return out


def _no_eos_tokenizer(path: Path) -> Path:
    """A word-level tokenizers JSON file with no end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "[UNK] the quick brown fox jumps over lazy dog. hello world".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.fixture
def w(tmp_path):
    """A workspace: victim.txt, corpus/{a.txt, sub/b.md}, an empty outdir/, tok.json."""
    root = tmp_path.resolve()
    (root / "victim.txt").write_text(TEXT)
    (root / "corpus" / "sub").mkdir(parents=True)
    (root / "corpus" / "a.txt").write_text(TEXT)
    (root / "corpus" / "sub" / "b.md").write_text("# Notes\n\nhello world. " * 20)
    (root / "outdir").mkdir()
    _no_eos_tokenizer(root / "tok.json")
    return root


def _tokenize(w, args, capsys):
    """``tokenize_corpus.main`` in-process: (exit status, stderr lines)."""
    code = tc.main([a.format(w=w) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def _setup_symlink(w):
    (w / "link.bin").symlink_to(w / "victim.txt")


def _setup_hardlink(w):
    os.link(w / "victim.txt", w / "hard.bin")


def _setup_dir_link(w):
    (w / "cl").symlink_to(w / "corpus")


def _setup_tokenizer_copy(name):
    return lambda w: (w / name).write_bytes((w / "tok.json").read_bytes())


def _setup_text(name):
    return lambda w: (w / name).write_text(TEXT)


OVERWRITES = {
    "the-corpus-file": (
        None,
        ["{w}/victim.txt", "--output", "{w}/victim.txt"],
        "output='{w}/victim.txt': is the corpus file {w}/victim.txt",
    ),
    "through-dotdot": (
        None,
        ["{w}/victim.txt", "--output", "{w}/corpus/../victim.txt"],
        "output='{w}/corpus/../victim.txt': is the corpus file {w}/victim.txt",
    ),
    "through-a-symlink": (
        _setup_symlink,
        ["{w}/victim.txt", "--output", "{w}/link.bin"],
        "output='{w}/link.bin': is the corpus file {w}/victim.txt (through a symlink)",
    ),
    "a-hard-link": (
        _setup_hardlink,
        ["{w}/victim.txt", "--output", "{w}/hard.bin"],
        "output='{w}/hard.bin': is the corpus file {w}/victim.txt (a hard link)",
    ),
    "inside-a-corpus-directory": (
        None,
        ["{w}/corpus", "--output", "{w}/corpus/sub/out.bin"],
        "output='{w}/corpus/sub/out.bin': lies inside the corpus directory {w}/corpus",
    ),
    "inside-it-through-a-symlink": (
        _setup_dir_link,
        ["{w}/corpus", "--output", "{w}/cl/out.bin"],
        "output='{w}/cl/out.bin': lies inside the corpus directory {w}/corpus",
    ),
    "a-file-a-glob-matched": (
        None,
        ["{w}/corpus/*.txt", "--output", "{w}/corpus/a.txt"],
        "output='{w}/corpus/a.txt': is the corpus file {w}/corpus/a.txt",
    ),
    "the-tokenizer": (
        _setup_tokenizer_copy("tok"),
        ["{w}/victim.txt", "--output", "{w}/tok", "--tokenizer", "{w}/tok"],
        "output='{w}/tok': is the tokenizer file {w}/tok",
    ),
    "its-sidecar-is-the-tokenizer": (
        _setup_tokenizer_copy("t.bin.json"),
        ["{w}/victim.txt", "--output", "{w}/t.bin", "--tokenizer", "{w}/t.bin.json"],
        "output='{w}/t.bin': its sidecar {w}/t.bin.json is the tokenizer file {w}/t.bin.json",
    ),
    "its-sidecar-is-a-corpus-file": (
        _setup_text("y.bin.json"),
        ["{w}/victim.txt", "{w}/y.bin.json", "--output", "{w}/y.bin"],
        "output='{w}/y.bin': its sidecar {w}/y.bin.json is the corpus file {w}/y.bin.json",
    ),
    "its-trained-tokenizer-is-a-corpus-file": (
        _setup_text("x.bin.tokenizer.json"),
        ["{w}/victim.txt", "{w}/x.bin.tokenizer.json", "--output", "{w}/x.bin"],
        "output='{w}/x.bin': its tokenizer {w}/x.bin.tokenizer.json is the corpus file "
        "{w}/x.bin.tokenizer.json",
    ),
}


@pytest.mark.parametrize("case", OVERWRITES, ids=list(OVERWRITES))
def test_an_output_that_is_an_input_is_refused_and_nothing_changes(case, w, capsys):
    setup, args, message = OVERWRITES[case]
    if setup is not None:
        setup(w)
    before = _snapshot(w)
    code, err = _tokenize(w, args, capsys)
    assert (code, err) == (2, ["error: " + message.format(w=w)])
    assert _snapshot(w) == before  # every input's digest, and nothing new (no temporary)


def test_check_outputs_is_one_reusable_function(w):
    from experiments import files

    files.check_outputs({"data": [w / "corpus"]}, {"": w / "elsewhere.bin"}, "out", "x")
    with pytest.raises(ValueError, match=r"^out='x': its log .* is the data file .*a\.txt$"):
        files.check_outputs(
            {"data": [w / "corpus" / "a.txt"]}, {"its log": w / "corpus" / "a.txt"}, "out", "x"
        )


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (None, ["{w}/corpus", "-o", "{w}/outdir"], "output='{w}/outdir': is a directory"),
        (
            lambda w: (w / "o.bin.json").mkdir(),
            ["{w}/corpus", "-o", "{w}/o.bin"],
            "output='{w}/o.bin': its sidecar {w}/o.bin.json is a directory",
        ),
        (
            lambda w: os.mkfifo(w / "fifo"),
            ["{w}/corpus", "-o", "{w}/fifo"],
            "output='{w}/fifo': is not a regular file",
        ),
        (
            None,
            ["{w}/corpus", "-o", "{w}/nope/out.bin"],
            "output='{w}/nope/out.bin': its directory does not exist",
        ),
    ],
    ids=["a-directory", "its-sidecar-a-directory", "a-fifo", "no-directory"],
)
def test_an_output_that_cannot_be_a_file_is_one_line_and_writes_nothing(
    setup, args, message, w, capsys
):
    if setup is not None:
        setup(w)
    before = _snapshot(w)
    code, err = _tokenize(w, args, capsys)
    assert (code, err) == (2, ["error: " + message.format(w=w)])
    assert _snapshot(w) == before


def test_an_output_in_an_unwritable_directory_is_one_line(w, capsys):
    ro = w / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root writes anywhere: a directory even root cannot write in
        ro = Path("/sys")
        if not ro.is_dir():
            pytest.skip("no directory this user cannot write in")
    before, there = _snapshot(w), sorted(os.listdir(ro))
    code, err = _tokenize(w, ["{w}/corpus", "-o", f"{ro}/out.bin"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: output='{ro}/out.bin': ")
    assert "not writable" in err[0] or "cannot write in its directory" in err[0]
    assert _snapshot(w) == before and sorted(os.listdir(ro)) == there


def test_a_run_that_fails_half_way_leaves_nothing_and_keeps_the_old_output(w, capsys):
    out = w / "outdir" / "c.bin"

    def interrupt(done, total, tokens):
        raise KeyboardInterrupt  # Ctrl-C while tokenizing

    before = _snapshot(w)
    with pytest.raises(KeyboardInterrupt):
        tc.tokenize_corpus([w / "corpus"], out, vocab_size=300, progress=interrupt)
    assert _snapshot(w) == before  # no temporary, no tokenizer, no partial tokens
    tc.tokenize_corpus([w / "victim.txt"], out, vocab_size=300)
    before = _snapshot(w)  # an old token file, its sidecar and its tokenizer
    with pytest.raises(KeyboardInterrupt):
        tc.tokenize_corpus([w / "corpus"], out, vocab_size=300, progress=interrupt)
    assert _snapshot(w) == before
    # a refusal half-way (the text gives no tokens) is one line and leaves nothing either
    (w / "blank.txt").write_text("   \n\t  ")
    before = _snapshot(w)
    code, err = _tokenize(
        w, ["{w}/blank.txt", "-o", f"{out}", "--tokenizer", "{w}/tok.json"], capsys
    )
    assert (code, err) == (2, [f"error: corpus='{w}/blank.txt': the text gave no tokens"])
    assert _snapshot(w) == before


class _Killed(BaseException):
    """The process dying at a rename (not an Exception: nothing may catch it)."""


def test_the_files_are_renamed_so_a_token_file_always_has_its_own_sidecar(w, monkeypatch):
    """The trained tokenizer, then the sidecar, then the token file: a kill between any two
    renames never leaves a token file without a sidecar, nor one a run reads with another
    run's sidecar (the old pair, the new pair, or a pair a run refuses)."""
    out, real = w / "outdir" / "c.bin", os.replace
    renamed = []

    def record(src, dst):
        renamed.append(Path(dst).name)
        real(src, dst)

    monkeypatch.setattr(os, "replace", record)
    tc.tokenize_corpus([w / "corpus"], out, vocab_size=300)
    assert renamed == ["c.bin.tokenizer.json", "c.bin.json", "c.bin"]
    new = np.fromfile(out, np.uint16).tobytes()
    for old in (None, "victim.txt"):
        for n in (1, 2, 3):
            for p in (w / "outdir").iterdir():
                p.unlink()
            monkeypatch.setattr(os, "replace", real)
            if old is not None:
                tc.tokenize_corpus([w / old], out, vocab_size=300)
            before = np.fromfile(out, np.uint16).tobytes() if old is not None else None
            calls = []

            def dying(src, dst, n=n, calls=calls):
                calls.append(dst)
                if len(calls) == n:
                    raise _Killed(dst)
                real(src, dst)

            monkeypatch.setattr(os, "replace", dying)
            with pytest.raises(_Killed):
                tc.tokenize_corpus([w / "corpus"], out, vocab_size=300)
            monkeypatch.setattr(os, "replace", real)
            if not out.exists():
                continue
            assert tc.sidecar_path(out).exists(), (old, n)  # never a bare token file
            try:
                tokens = np.asarray(data.TokenFile(out).tokens)
            except ValueError as e:  # new sidecar, old tokens: refused, not misread
                assert "from different runs" in str(e)
            else:  # the old pair or the new one, whole
                assert tokens.tobytes() in (new, before), (old, n)


def test_every_output_goes_through_the_one_atomic_writer(w, monkeypatch):
    from experiments import files

    target = w / "outdir" / "f.bin"
    files.write_atomic(target, b"old")
    with pytest.raises(RuntimeError), files.atomic_writer(target) as f:
        f.write(b"new, half")
        raise RuntimeError("failed")
    assert target.read_bytes() == b"old" and os.listdir(w / "outdir") == ["f.bin"]
    with files.atomic_writer(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(w / "outdir") == ["f.bin"]
    committed, real = [], files.replace_synced

    def record(tmp, path):
        committed.append(Path(path).name)
        real(tmp, path)

    monkeypatch.setattr(files, "replace_synced", record)
    tc.tokenize_corpus([w / "corpus"], w / "outdir" / "c.bin", vocab_size=300)
    assert committed == ["c.bin.tokenizer.json", "c.bin.json", "c.bin"]


@pytest.fixture
def mixed(tmp_path):
    """Two UTF-8 text files among a binary, Latin-1 text, text with a NUL byte, an empty file."""
    d = tmp_path / "mixed"
    d.mkdir()
    files = {
        "a.txt": TEXT.encode(),
        "b.bin": bytes(range(256)) * 8,
        "c.txt": "café au lait ".encode("latin-1") * 20,
        "d.txt": b"hello\x00world " * 20,
        "e.txt": b"",
        "f.md": "Ünïcödé ✓ hello world. ".encode() * 20,
    }
    for name, blob in files.items():
        (d / name).write_bytes(blob)
    return d, files


def test_text_runs_and_the_tokenizer_keep_the_same_files(mixed, capsys):
    d, files = mixed
    assert [n for n in sorted(files) if sources.is_text(d / n)] == ["a.txt", "f.md"]
    notes = []
    info = tc.tokenize_corpus([d], d.parent / "t.bin", vocab_size=300, warn=notes.append)
    assert (info["documents"], info["skipped"]) == (2, 4)
    assert notes == [f"corpus='{d}': skipped 4 of 6 files (1 empty, 3 not UTF-8 text)"]
    text = data.ByteText(d)
    assert text.tokens.tobytes() == files["a.txt"] + files["f.md"]
    capsys.readouterr()
    streams = data.make_streams("text", path=str(d), replicas=1, steps_per_round=1, seq_len=8)
    assert len(streams.sources[0]) == len(files["a.txt"]) + len(files["f.md"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"warning: data.path={d}: skipped 4 of 6 files (1 empty, 3 not UTF-8 text); reading "
        "the other 2"
    ]


def test_a_folder_of_binaries_is_refused_for_training_and_tokenizing(tmp_path, capsys):
    d = tmp_path / "bins"
    d.mkdir()
    for name in ("x.dat", "y.dat"):
        (d / name).write_bytes(bytes(range(256)) * 64)
    why = "none of its 2 files is UTF-8 text (2 not UTF-8 text)"
    with pytest.raises(ValueError, match=rf"^path='{re.escape(str(d))}': {re.escape(why)}$"):
        data.make_streams("text", path=str(d), replicas=1, steps_per_round=1)
    assert tc.main([str(d), "-o", str(tmp_path / "t.bin")]) == 2
    assert capsys.readouterr().err.strip() == f"error: corpus='{d}': {why}"
    with pytest.raises(SystemExit) as code:
        train.main(
            ["--preset", "micro", f"log.dir={tmp_path / 'logs'}", "log.tensorboard=false",
             "train.rounds=1", "data.kind=text", f"data.path={d}", "data.vocab_size=256"]
        )  # fmt: skip
    assert code.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: data.path={d}: {why}"
    assert not (tmp_path / "logs").exists() and not (tmp_path / "t.bin").exists()


def test_an_empty_file_is_said_to_be_empty(tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert tc.main([str(tmp_path / "empty.txt"), "-o", str(tmp_path / "t.bin")]) == 2
    assert capsys.readouterr().err.strip() == f"error: corpus='{tmp_path / 'empty.txt'}': is empty"
    with pytest.raises(ValueError, match=r"^path='.*empty\.txt': is empty$"):
        data.ByteText(str(tmp_path / "empty.txt"))
    (tmp_path / "blank").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "blank" / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"^path='.*blank': its 2 files are empty$"):
        data.ByteText(str(tmp_path / "blank"))
    assert set(os.listdir(tmp_path)) == {"empty.txt", "blank"}  # nothing written


def test_a_tokenizer_with_no_end_of_text_token_is_warned_about(w, capsys):
    out = w / "outdir" / "c.bin"
    code, err = _tokenize(w, ["{w}/corpus", "-o", f"{out}", "--tokenizer", "{w}/tok.json"], capsys)
    assert code == 0 and len(err) == 1, err
    assert err[0].startswith(f"warning: tokenizer='{w}/tok.json': has no end-of-text token")
    assert "joined with no separator" in err[0] and "--eos" in err[0]
    assert json.loads(tc.sidecar_path(out).read_text())["eos_id"] is None


def _run_tokens(tmp_path, capsys, *extra):
    with pytest.raises(SystemExit) as code:
        train.main(
            ["--preset", "micro", f"log.dir={tmp_path / 'logs'}", "log.tensorboard=false",
             "train.rounds=1", "data.kind=tokens", *extra]
        )  # fmt: skip
    assert code.value.code == 2 and not (tmp_path / "logs").exists()
    return capsys.readouterr().err.strip()


def test_a_token_file_read_with_the_wrong_dtype_blames_the_dtype(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(0, 300, 10_000)
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    ids.astype(np.uint32).tofile(tmp_path / "u32.bin")
    with pytest.raises(ValueError, match=r"^dtype='uint32': .*uint16") as e:
        data.TokenFile(tmp_path / "u16.bin", "uint32", vocab_size=300)
    assert "vocab" not in str(e.value).split(":")[0]
    with pytest.raises(ValueError, match=r"^dtype='uint32': .*uint16"):
        data.TokenFile(tmp_path / "u16.bin", "uint32")  # no vocabulary given either
    with pytest.raises(ValueError, match=r"^dtype='auto': .*uint32"):
        data.TokenFile(tmp_path / "u32.bin", vocab_size=300)  # no sidecar: read as uint16
    err = _run_tokens(
        tmp_path, capsys, f"data.path={tmp_path / 'u16.bin'}", "data.token_dtype=uint32",
        "data.vocab_size=300",
    )  # fmt: skip
    assert err.startswith("error: data.token_dtype=uint32: ") and "uint16" in err, err
    assert "\n" not in err
    err = _run_tokens(tmp_path, capsys, f"data.path={tmp_path / 'u32.bin'}", "data.vocab_size=300")
    assert err.startswith("error: data.token_dtype=") and "uint32" in err and "\n" not in err


def _command(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tokenize_corpus", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def test_the_command_refuses_in_one_line_with_status_2(w):
    before = _snapshot(w)
    code, err = _command("victim.txt", "--output", "victim.txt", cwd=w)
    assert (code, err) == (2, ["error: output='victim.txt': is the corpus file victim.txt"])
    code, err = _command("corpus", "--output", "outdir", cwd=w)
    assert (code, err) == (2, ["error: output='outdir': is a directory"])
    assert _snapshot(w) == before
