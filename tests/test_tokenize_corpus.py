"""Text to tokens with a real tokenizer (experiments.tokenize_corpus), the token file's sidecar,
and a run that trains on it or refuses it in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments import data, train
from experiments import tokenize_corpus as tc

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[1]

TEXTS = {
    "a.txt": "The quick brown fox jumps over the lazy dog. " * 30 + "Ünïcödé ✓ stays.\n",
    "sub/b.md": "# Notes\n\nOuter optimizers average pseudo-gradients every H steps. " * 25,
    "sub/c.py": "def f(x):\n    return x * 2  # doubled\n" * 40,
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    return root


def _documents(path, info):
    """The token file split back into documents at the end-of-text id."""
    ids = np.fromfile(path, info["dtype"])
    cuts = np.flatnonzero(ids == info["eos_id"])
    assert cuts[-1] == ids.size - 1  # every document ends with it
    return np.split(ids, cuts + 1)[:-1]


def test_a_trained_tokenizer_round_trips_every_document(corpus, tmp_path):
    out = tmp_path / "corpus.bin"
    info = tc.tokenize_corpus([corpus], out, vocab_size=400)
    assert info == json.loads(tc.sidecar_path(out).read_text()) | {"skipped": 0}
    assert (info["dtype"], info["documents"]) == ("uint16", 3)
    assert 300 < info["vocab_size"] <= 400  # fewer when the corpus runs out of merges
    assert out.stat().st_size == 2 * info["tokens"]
    tok = tc.load_tokenizer(tmp_path / info["tokenizer"])  # saved beside it, relative path
    assert (
        tok.vocab_size == info["vocab_size"] and tok.id_of("<|endoftext|>") == info["eos_id"] == 0
    )
    docs = _documents(out, info)
    order = sorted(TEXTS)  # files in sorted path order: a.txt, sub/b.md, sub/c.py
    assert [tok.decode(d[:-1].tolist()) for d in docs] == [TEXTS[n] for n in order]
    ids = np.fromfile(out, np.uint16)
    assert (
        ids.max() < info["vocab_size"]
        and 0.05 < info["tokens"] / sum(map(len, TEXTS.values())) < 0.8
    )


def test_training_is_deterministic_and_a_brought_tokenizer_gives_its_own_ids(corpus, tmp_path):
    a, b, c = (tmp_path / f"{n}.bin" for n in "abc")
    tc.tokenize_corpus([corpus], a, vocab_size=300)
    tc.tokenize_corpus([corpus], b, vocab_size=300)
    assert a.read_bytes() == b.read_bytes()
    assert tc.sidecar_path(a).read_text() != ""
    assert (
        tmp_path.joinpath("a.bin.tokenizer.json").read_text()
        == tmp_path.joinpath("b.bin.tokenizer.json").read_text()
    )
    # the user brings that tokenizer for another text: its own encoding, nothing trained
    (tmp_path / "more.txt").write_text("the lazy fox notes pseudo-gradients")
    info = tc.tokenize_corpus(
        [tmp_path / "more.txt"], c, tokenizer=tmp_path / "a.bin.tokenizer.json"
    )
    assert not (tmp_path / "c.bin.tokenizer.json").exists()
    assert info["tokenizer"] == "a.bin.tokenizer.json"
    assert info["vocab_size"] == json.loads(tc.sidecar_path(a).read_text())["vocab_size"]
    tok = tc.load_tokenizer(tmp_path / "a.bin.tokenizer.json")
    expected = tok.encode(["the lazy fox notes pseudo-gradients"])[0] + [0]
    assert np.fromfile(c, np.uint16).tolist() == expected


def test_a_glob_picks_its_files_and_binary_files_are_skipped(corpus, tmp_path):
    (corpus / "blob.bin").write_bytes(bytes(range(256)) * 4)  # not UTF-8
    out = tmp_path / "t.bin"
    info = tc.tokenize_corpus([corpus], out, vocab_size=300)
    assert (info["documents"], info["skipped"]) == (3, 1)
    info = tc.tokenize_corpus([str(corpus / "**" / "*.md")], out, vocab_size=300)
    assert info["documents"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["{root}/nothing_here"], "error: corpus='{root}/nothing_here': matches no file"),
        (["{root}/binary"], "error: corpus='{root}/binary': none of its 1 files is UTF-8 text"),
        (
            ["{root}/corpus", "--vocab-size", "100"],
            "error: vocab_size=100: must be >= 257 (256 bytes + end of text)",
        ),
        (
            ["{root}/corpus", "--tokenizer", "{root}/missing.json"],
            "error: tokenizer='{root}/missing.json': is not a file",
        ),
        (
            ["{root}/corpus", "--tokenizer", "{root}/corpus/a.txt"],
            "error: tokenizer='{root}/corpus/a.txt': not a tokenizers JSON file",
        ),
        (
            ["{root}/corpus", "--tokenizer", "{root}/x.model"],
            "error: tokenizer='{root}/x.model': ",
        ),
        (["{root}/corpus", "--eos", "<nope>"], "error: eos='<nope>': not a token"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(args, message, corpus, tmp_path, capsys):
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.dat").write_bytes(b"\xff\xfe\x00\x81" * 100)
    (tmp_path / "x.model").write_bytes(b"not a model")
    out = tmp_path / "out.bin"
    argv = [a.format(root=tmp_path) for a in args] + ["--output", str(out)]
    assert tc.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message.format(root=tmp_path)) and "\n" not in err, err
    assert not out.exists() and not tc.sidecar_path(out).exists()


def _token_file(tmp_path, ids, dtype, **side):
    path = tmp_path / "t.bin"
    np.asarray(ids, dtype).tofile(path)
    info = {"format": "co2jax.tokens", "version": 1, "dtype": dtype, "vocab_size": 50}
    info |= {"tokens": len(ids)} | side
    tc.sidecar_path(path).write_text(json.dumps(info))
    return path


def test_the_sidecar_sets_the_dtype_and_refuses_what_disagrees(tmp_path):
    ids = np.arange(1000) % 50
    path = _token_file(tmp_path, ids, "uint32")
    f = data.TokenFile(path)  # auto: the sidecar's uint32, its vocabulary
    assert f.vocab_size == 50 and np.array_equal(np.asarray(f.tokens[:1000]), ids)
    with pytest.raises(ValueError, match=r"^dtype='uint16': t.bin holds uint32 tokens"):
        data.TokenFile(path, "uint16")
    with pytest.raises(ValueError, match=r"^vocab_size=64: t.bin was tokenized with .* of 50"):
        data.TokenFile(path, "auto", vocab_size=64)
    path = _token_file(tmp_path, ids, "uint32", tokens=999)
    with pytest.raises(ValueError, match=r"4000 bytes, but t.bin.json describes 999 uint32"):
        data.TokenFile(path)
    tc.sidecar_path(path).write_text("{not json")
    with pytest.raises(ValueError, match=r"its sidecar t.bin.json is unreadable"):
        data.TokenFile(path)


def _run_args(tmp_path, *extra):
    return [
        "--preset",
        "micro",
        f"log.dir={tmp_path / 'logs'}",
        "log.tensorboard=false",
        "train.rounds=1",
        "data.kind=tokens",
        *extra,
    ]


_VOLATILE = ("seconds", "tokens_per_s")  # wall-clock fields: the only ones that may differ


def _records(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in _VOLATILE} for row in rows]


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_tokenize_train_kill_and_resume_ends_bitwise_equal(corpus, tmp_path):
    """The documented sequence at R = 4 x 2: tokenize a corpus, train on it through Grain, kill
    the run (SIGKILL, in a process of its own) after a checkpoint, resume: every record of the
    resumed run equals the uninterrupted run's, bit for bit."""
    out = tmp_path / "corpus.bin"
    info = tc.tokenize_corpus([corpus], out, vocab_size=300)
    common = [
        "--preset", "micro", "log.tensorboard=false", "train.rounds=8", "checkpoint.every=1",
        "data.kind=tokens", f"data.path={out}", f"data.vocab_size={info['vocab_size']}",
        "mesh.replica=4", "mesh.data=2",
    ]  # fmt: skip

    def args(name):
        return [*common, f"log.dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name}-ckpt"]

    train.main(args("straight"))
    straight = _records(tmp_path / "straight" / "micro" / "metrics.jsonl")
    assert [r["round"] for r in straight] == list(range(1, 9))
    assert straight[0]["train_loss"] < np.log(info["vocab_size"]) + 1.0

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "experiments.train", *args("killed")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    second = tmp_path / "killed-ckpt" / "2"
    deadline = time.monotonic() + 300
    while not second.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == -signal.SIGKILL, err[-500:]  # killed, not finished
    kept = _records(tmp_path / "killed" / "micro" / "metrics.jsonl")
    assert 2 <= len(kept) < 8
    train.main([*args("killed"), "--resume"])
    assert _records(tmp_path / "killed" / "micro" / "metrics.jsonl") == straight


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["data.vocab_size=32"],
            "error: data.vocab_size=32: corpus.bin was tokenized with a vocabulary of {v}",
        ),
        (
            ["data.vocab_size={v}", "data.token_dtype=uint32"],
            "error: data.token_dtype=uint32: corpus.bin holds uint16 tokens (corpus.bin.json)",
        ),
    ],
)
def test_a_run_refuses_a_token_file_that_disagrees_in_one_line(
    extra, message, corpus, tmp_path, capsys
):
    out = tmp_path / "corpus.bin"
    v = tc.tokenize_corpus([corpus], out, vocab_size=300)["vocab_size"]
    with pytest.raises(SystemExit) as code:
        train.main(_run_args(tmp_path, f"data.path={out}", *(e.format(v=v) for e in extra)))
    assert code.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message.format(v=v)) and "\n" not in err, err
    assert not (tmp_path / "logs").exists()


def test_a_token_file_of_the_wrong_size_is_one_line(tmp_path, capsys):
    (tmp_path / "odd.bin").write_bytes(b"hello")
    with pytest.raises(SystemExit):
        train.main(_run_args(tmp_path, f"data.path={tmp_path / 'odd.bin'}"))
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: data.path={tmp_path / 'odd.bin'}: 5 bytes is not"), err
    assert "\n" not in err and not (tmp_path / "logs").exists()


def test_a_sentencepiece_model_the_user_brings(corpus, tmp_path):
    """A SentencePiece model (trained here with the sentencepiece package: what Llama-family
    models ship) tokenizes the corpus with its own ids and its own end-of-text id."""
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        input=",".join(str(corpus / n) for n in sorted(TEXTS)),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=60,
        hard_vocab_limit=False,  # the small corpus may give fewer pieces
        eos_id=2,
        minloglevel=2,
    )
    out = tmp_path / "sp.bin"
    info = tc.tokenize_corpus([corpus / "sub"], out, tokenizer=tmp_path / "sp.model")
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert info["vocab_size"] == processor.get_piece_size() > 30
    assert (info["eos_id"], info["dtype"]) == (2, "uint16")
    expected = [i for n in sorted(TEXTS)[1:] for i in [*processor.encode(TEXTS[n]), 2]]
    assert np.fromfile(out, np.uint16).tolist() == expected
