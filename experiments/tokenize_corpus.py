"""Text to a token file: a real tokenizer over local text, its vocabulary recorded beside it.

    python -m experiments.tokenize_corpus CORPUS... --output corpus.bin [--tokenizer FILE]
        [--vocab-size 4096] [--min-frequency 2] [--eos TOKEN]

``CORPUS``: files, directories (every non-hidden file under them, recursively, sorted) or glob
patterns; each file is one document, decoded as UTF-8. Files that are not text are skipped,
and a one-line warning says how many of each kind: empty, or not UTF-8 text (bytes that do not
decode, or a NUL byte: :func:`experiments.sources.is_text`, the rule ``data.kind=text`` reads
by too). The tokenizer is

- the one the user brings: a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), or a
  SentencePiece ``.model`` (read with the ``sentencepiece`` package, when installed);
- or, with no ``--tokenizer``, a byte-level BPE trained on the corpus itself with the
  ``tokenizers`` library (up to ``--vocab-size`` entries, ``<|endoftext|>`` included: fewer
  when the corpus runs out of pairs seen ``--min-frequency`` times), saved as
  ``<output>.tokenizer.json``. Nothing is downloaded.

Documents are joined with the end-of-text token (``--eos``; by default the tokenizer's own:
``<|endoftext|>``, ``</s>``, ``<eos>`` or ``<|end_of_text|>``). A brought tokenizer with
none of these is warned about in one line: its documents are joined with no separator (name
the token that ends a document with ``--eos``). The tokens go to ``--output`` as a flat
array of ``uint16`` (vocabularies up to 65,536) or ``uint32`` (``np.tofile``,
little-endian: what ``data.kind=tokens`` memory-maps), and a sidecar ``<output>.json``
records what a run must agree with::

    {"format": "co2jax.tokens", "version": 1, "dtype": "uint16", "vocab_size": 4096,
     "tokens": 1234567, "documents": 42, "eos_id": 0, "tokenizer": "corpus.bin.tokenizer.json"}

A run reading the file (``data.kind=tokens data.path=corpus.bin``) takes the dtype from the
sidecar and refuses, in one line before anything compiles, a ``data.vocab_size`` or
``data.token_dtype`` that disagrees with it, and a file whose size is not the sidecar's count.

Refused in one line (``error: <setting>=<value>: <why>``, exit status 2) before anything is
written, the outputs before anything is read: an output (the token file, its sidecar, the
trained tokenizer) that is an input (a corpus file, a file a directory or glob matched, the
``--tokenizer`` file; also through a symlink, a hard link or ``..``) or lies inside a corpus
directory (:func:`experiments.files.check_outputs`); an output that is a directory or not a
regular file, or whose directory does not exist or cannot be written in. Then, before any
token is written: a corpus with no text, a tokenizer file that is not one, an unknown
``--eos`` token. Every output goes through the one
atomic writer (:func:`experiments.files.atomic_writer`): written under a temporary name,
flushed, renamed into place once all of it is written, in the order trained tokenizer,
sidecar, token file (so a token file never stands without the sidecar describing it; a kill
between two renames leaves the new sidecar beside the old token file, which a run refuses as
from different runs). A run that fails or is interrupted half-way (the text gives no tokens,
Ctrl-C) leaves nothing: no temporary, and an old output as it was.

Example:
  >>> import pathlib, tempfile
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (d / "a.txt").write_text("the cat sat on the mat. " * 20)
  >>> info = tokenize_corpus([d / "a.txt"], d / "out.bin", vocab_size=300)
  >>> info["dtype"], info["documents"], info["eos_id"], 257 < info["vocab_size"] <= 300
  ('uint16', 1, 0, True)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.files import atomic_writer, check_output_file, check_outputs
from experiments.sources import (
    FORMAT,
    VERSION,
    keep_text,
    resolve_paths,
    sidecar_path,
    skipped_note,
)

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_BATCH = 64  # documents encoded per call (the tokenizers library encodes a batch in parallel)


def _shown(paths: Sequence[str | os.PathLike]) -> str | list[str]:
    return str(paths[0]) if len(paths) == 1 else [str(p) for p in paths]


def matched(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Every file ``paths`` names (:func:`experiments.sources.resolve_paths`), nothing read
    yet. Raises ``ValueError`` naming the entry that matches no file."""
    try:
        return resolve_paths([str(p) for p in paths])
    except ValueError as e:
        raise ValueError(str(e).replace("path=", "corpus=", 1)) from None


def _read(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # changed since it was judged text
        raise ValueError(f"corpus={str(f)!r}: cannot be read as UTF-8 text ({e})") from None


class Tokenizer:
    """What tokenizing needs of a tokenizer: ``encode(texts) -> list of id lists``,
    ``vocab_size``, ``id_of(token)`` (None when absent) and ``decode(ids)``."""

    def __init__(self, encode, decode, vocab_size: int, id_of, source: str):
        self.encode, self.decode, self.vocab_size = encode, decode, vocab_size
        self.id_of, self.source = id_of, source


def _from_hf(tok, source: str) -> Tokenizer:
    return Tokenizer(
        encode=lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        id_of=tok.token_to_id,
        source=source,
    )


def _first_line(error: Exception) -> str:
    """A library's error as one line: its message's first line, or its type's name."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer the user brings: a ``tokenizers`` JSON file or a SentencePiece model."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tokenizer={str(path)!r}: is not a file")
    if p.suffix == ".model":
        try:
            import sentencepiece as spm
        except ImportError:
            raise ValueError(
                f"tokenizer={str(path)!r}: a SentencePiece model needs the sentencepiece "
                "package (pip install sentencepiece), or bring a tokenizers JSON file"
            ) from None
        try:
            sp = spm.SentencePieceProcessor(model_file=str(p))
        except Exception as e:
            raise ValueError(
                f"tokenizer={str(path)!r}: not a SentencePiece model ({_first_line(e)})"
            ) from None

        def id_of(token: str) -> int | None:
            i = sp.piece_to_id(token)
            return None if i == sp.unk_id() and token != sp.id_to_piece(i) else i

        return Tokenizer(
            lambda texts: sp.encode(list(texts)), sp.decode, sp.get_piece_size(), id_of, str(p)
        )
    from tokenizers import Tokenizer as HF

    try:
        tok = HF.from_file(str(p))
    except Exception as e:
        raise ValueError(
            f"tokenizer={str(path)!r}: not a tokenizers JSON file or a SentencePiece .model "
            f"({_first_line(e)})"
        ) from None
    return _from_hf(tok, str(p))


def train_tokenizer(files: Sequence[Path], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE (the GPT-2 family's scheme: any text, no unknown token) trained on
    ``files`` with the ``tokenizers`` library: ``<|endoftext|>`` is id 0, then the 256 byte
    symbols, then merges up to ``vocab_size``. Deterministic for the same files."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 257 (256 bytes + end of text)")
    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_CANDIDATES[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_read(f) for f in files), trainer, length=len(files))
    return tok


def _eos_id(tokenizer: Tokenizer, eos: str | None) -> int | None:
    if eos is not None:
        i = tokenizer.id_of(eos)
        if i is None:
            raise ValueError(f"eos={eos!r}: not a token of the tokenizer {tokenizer.source}")
        return i
    return next((i for t in EOS_CANDIDATES if (i := tokenizer.id_of(t)) is not None), None)


def _encoded(tokenizer: Tokenizer, files: list[Path], eos: int | None) -> Iterator[list[int]]:
    for start in range(0, len(files), _BATCH):
        batch = files[start : start + _BATCH]
        for ids in tokenizer.encode([_read(f) for f in batch]):
            yield ids + ([] if eos is None else [eos])


def tokenize_corpus(
    corpus: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    eos: str | None = None,
    progress=None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``corpus`` into ``output`` and its sidecar (module docstring); returns the
    sidecar's fields (plus ``skipped``: how many files were left out as not text). Bad input
    raises ``ValueError`` before anything is read or written; ``warn`` gets the one-line
    warnings (default: :func:`warnings.warn`)."""
    if warn is None:
        warn = lambda message: warnings.warn(message, stacklevel=3)
    typed, output = str(output), Path(output)
    if output.suffix == ".json":
        raise ValueError(f"output={typed!r}: the token file's sidecar is <output>.json")
    if tokenizer is None and vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 257 (256 bytes + end of text)")
    side, saved = sidecar_path(output), Path(f"{output}.tokenizer.json")
    outputs = {"": output, "its sidecar": side}
    if tokenizer is None:
        outputs["its tokenizer"] = saved
    for subject, path in outputs.items():
        check_output_file(path, "output", typed, subject)
    files = matched(corpus)
    inputs = {"corpus": [*files, *(Path(c) for c in corpus if Path(c).is_dir())]}
    if tokenizer is not None:
        inputs["tokenizer"] = [Path(tokenizer)]
    check_outputs(inputs, outputs, "output", typed)
    with contextlib.ExitStack() as stack:
        try:  # the token file's temporary first: a directory that cannot be written in says so
            f = stack.enter_context(atomic_writer(output))
        except OSError as e:
            why = f"cannot write in its directory ({e.strerror})"
            raise ValueError(f"output={typed!r}: {why}") from None
        tok = None if tokenizer is None else load_tokenizer(tokenizer)
        eos_id = None if tok is None else _eos_id(tok, eos)  # a brought one: before reading
        texts, skipped = keep_text(files, [str(c) for c in corpus], "corpus")
        if skipped:
            n = sum(skipped.values())
            warn(
                f"corpus={_shown(corpus)!r}: skipped {n} of {n + len(texts)} files "
                f"({skipped_note(skipped)})"
            )
        trained = None
        if tok is None:
            trained = train_tokenizer(texts, vocab_size, min_frequency)
            tok = _from_hf(trained, str(saved))
            eos_id = _eos_id(tok, eos)
        dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
        if eos_id is None and len(texts) > 1:
            warn(
                f"tokenizer={str(tokenizer)!r}: has no end-of-text token "
                f"({', '.join(EOS_CANDIDATES)}): its {len(texts)} documents are joined with "
                "no separator; name the token that ends a document with --eos TOKEN"
            )
        count = 0
        for done, ids in enumerate(_encoded(tok, texts, eos_id)):
            np.asarray(ids, dtype.newbyteorder("<")).tofile(f)
            count += len(ids)
            if progress is not None:
                progress(done + 1, len(texts), count)
        if count == 0:
            raise ValueError(f"corpus={_shown(corpus)!r}: the text gave no tokens")
        info = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "tokens": count,
            "documents": len(texts),
            "eos_id": eos_id,
            "tokenizer": os.path.relpath(tok.source, output.parent),
        }
        # renamed when the blocks end, inner first: the tokenizer, the sidecar, the tokens
        with atomic_writer(side) as s:
            s.write((json.dumps(info, indent=1) + "\n").encode())
            if trained is not None:
                with atomic_writer(saved) as t:
                    t.write(trained.to_str(pretty=True).encode())
    return info | {"skipped": sum(skipped.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.tokenize_corpus",
        description="Tokenize local text into a token file for data.kind=tokens.",
    )
    parser.add_argument("corpus", nargs="+", help="text files, directories or glob patterns")
    parser.add_argument("--output", "-o", required=True, help="the token file to write (.bin)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizers JSON file or a SentencePiece .model (default: train a byte-level "
        "BPE on the corpus, saved as <output>.tokenizer.json)",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="when training (>= 257)")
    parser.add_argument("--min-frequency", type=int, default=2, help="when training: merges")
    parser.add_argument("--eos", default=None, help="the token ending each document")
    args = parser.parse_args(argv)
    if args.tokenizer is not None and (args.vocab_size != 4096 or args.min_frequency != 2):
        parser.error("--vocab-size and --min-frequency train a tokenizer: not with --tokenizer")
    if args.min_frequency < 1:
        parser.error(f"--min-frequency {args.min_frequency}: must be >= 1")

    shown = {"line": False}  # the progress line (a terminal only) is ended before a message

    def end_line() -> None:
        if shown["line"]:
            print(file=sys.stderr)
            shown["line"] = False

    def progress(done: int, total: int, tokens: int) -> None:
        if sys.stderr.isatty() and (done == total or done % 100 == 0):
            print(f"\r{done}/{total} documents, {tokens:,} tokens", end="", file=sys.stderr)
            shown["line"] = True

    def warn(message: str) -> None:
        end_line()
        print(f"warning: {message}", file=sys.stderr)

    try:
        info = tokenize_corpus(
            args.corpus,
            args.output,
            args.tokenizer,
            args.vocab_size,
            args.min_frequency,
            args.eos,
            progress,
            warn,
        )
    except ValueError as e:
        end_line()
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk, while writing (nothing is left: the writer cleans up)
        end_line()
        print(f"error: output={args.output!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    end_line()
    skipped = f" ({info['skipped']} files skipped: not text)" if info["skipped"] else ""
    print(
        f"{args.output}: {info['tokens']:,} {info['dtype']} tokens of {info['documents']} "
        f"documents{skipped}, vocabulary {info['vocab_size']} ({info['tokenizer']}); "
        f"train on it with: python -m experiments.train data.kind=tokens "
        f"data.path={args.output} data.vocab_size={info['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
