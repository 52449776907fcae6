"""The files a command writes: checked against what it reads, then written whole or not at all.

- :func:`check_output_file`: an output path can be a file (it is not a directory or a device,
  its directory exists and can be written in);
- :func:`check_outputs`: no output is an input (the same path, also through a symlink or
  ``..``, or a hard link to it) or lies inside an input directory;
- :func:`atomic_writer` (streaming) and :func:`write_atomic` (one value): the one atomic
  writer. Data goes to a temporary sibling (``.<name>.<random>.tmp``), which is flushed to the
  disk and renamed over the path (:func:`replace_synced`) when all of it is written, and
  removed on any exception (a refusal half-way included). A kill at any point leaves the old
  file or the new one, whole; only a process killed outright (SIGKILL, power loss) can leave
  a temporary behind, never a partial file under the path.

Both checks raise ``ValueError("<setting>=<value>: <why>")``, one line, before anything is
read or written.

Example:
  >>> import pathlib, tempfile
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (d / "in.txt").write_text("text")
  >>> check_outputs({"corpus": [d / "in.txt"]}, {"": d / "sub" / ".." / "in.txt"}, "output", "x")
  Traceback (most recent call last):
  ...
  ValueError: output='x': is the corpus file .../in.txt
  >>> with atomic_writer(d / "out.bin") as f:
  ...     _ = f.write(b"tokens")
  >>> (d / "out.bin").read_bytes(), sorted(p.name for p in d.iterdir())
  (b'tokens', ['in.txt', 'out.bin'])
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

PathLike = str | os.PathLike


def replace_synced(tmp: Path, path: Path) -> None:
    """Flushes ``tmp`` to the disk, then renames it over ``path`` (and flushes the directory,
    where the system allows): a kill at any point leaves the old file or the new one, whole."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself, on the disk (not on every system)
        fd = os.open(Path(path).parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary(path: PathLike) -> Path:
    """A fresh temporary sibling of ``path``: hidden, unique (two writers never share one)."""
    p = Path(path)
    return p.with_name(f".{p.name[:200]}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_writer(path: PathLike) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` when the block ends without an
    exception (:func:`replace_synced`); on any exception the temporary is removed and
    ``path`` is left as it was. The temporary is created on entry, so a directory that
    cannot be written in fails here (``OSError``), before the block runs. Blocks nested
    inside it are renamed into place before it: the outer file last."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    f = open(tmp, "xb")
    try:
        with f:
            yield f
        replace_synced(tmp, path)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_atomic(path: PathLike, data: str | bytes) -> None:
    """Writes ``data`` (a str as UTF-8) to ``path`` through :func:`atomic_writer`."""
    with atomic_writer(path) as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def save_figure(fig: Any, path: PathLike, **options: Any) -> None:
    """A matplotlib figure saved as PNG through :func:`atomic_writer` (``options``: those of
    ``savefig``): a report's plot is the old one or the new one, whole."""
    with atomic_writer(path) as f:
        fig.savefig(f, format="png", **options)


def _fail(setting: str, value: Any, why: str) -> None:
    raise ValueError(f"{setting}={str(value)!r}: {why}")


def check_output_file(path: PathLike, setting: str, value: Any, subject: str = "") -> None:
    """Raises ``ValueError("<setting>=<value>: [subject ]<why>")`` unless ``path`` can be
    written as a file: it is not a directory, a device, a pipe or a socket (a symlink is
    judged by its target), and its directory exists and can be written in. ``subject``
    names the file when it is not the one the setting names (``"its sidecar"``: the message
    then says ``its sidecar <path> is a directory``)."""
    p = Path(path)
    head = f"{subject} {p} " if subject else ""
    if p.is_dir():
        _fail(setting, value, f"{head}is a directory")
    if p.exists() and not p.is_file():
        _fail(setting, value, f"{head}is not a regular file")
    parent = p.parent
    if not parent.is_dir():
        where = "does not exist" if not parent.exists() else f"{parent} is not a directory"
        _fail(setting, value, f"{head}its directory {where}")
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(setting, value, f"{head}its directory {parent} is not writable")


def directory_problem(path: PathLike) -> str | None:
    """Why ``path`` cannot be a directory this process writes in, or None when it can: it,
    or the nearest of its ancestors that exists, is a file, or making a directory there
    fails (tried for real with a temporary directory, removed at once: permission bits say
    nothing for root, nor on a read-only or virtual file system such as ``/proc``). A URL
    (``gs://...``) is left to the library that writes it."""
    if "://" in str(path):
        return None
    p = Path(path).absolute()
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".probe-", dir=existing)
    except OSError as e:
        what = "" if existing == p else f"{existing}, where it would be made, "
        return f"{what}cannot be written in ({e.strerror})"
    os.rmdir(probe)
    return None


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        s = p.stat()
    except OSError:
        return None
    return (s.st_dev, s.st_ino)


def check_outputs(
    inputs: Mapping[str, Iterable[PathLike]],
    outputs: Mapping[str, PathLike],
    setting: str,
    value: Any,
) -> None:
    """Raises ``ValueError("<setting>=<value>: <why>")`` when writing ``outputs`` could change
    ``inputs``, before anything is read or written.

    ``inputs``: a label (``"corpus"``) to the paths read, files or directories (a directory:
    everything under it). ``outputs``: what names each output in the message (``""`` for the
    one the setting names, ``"its sidecar"``) to its path. Refused: an output that is an
    input file (the same path once symlinks and ``..`` are resolved, or the same device and
    inode: a hard link), and one that is an input directory or lies inside one (through a
    symlink too). Outputs that do not exist yet are compared by their resolved path.
    """
    files, dirs = [], []
    for label, paths in inputs.items():
        for given in paths:
            p = Path(given)
            entry = (label, p, p.resolve(), _identity(p))
            (dirs if p.is_dir() else files).append(entry)
    for subject, out in outputs.items():
        o = Path(out)
        head = f"{subject} {o} " if subject else ""
        real, ident = o.resolve(), _identity(o)
        linked = os.path.realpath(o) != os.path.abspath(o)
        for label, given, resolved, identity in files:
            if real == resolved:
                how = " (through a symlink)" if linked else ""
            elif ident is not None and ident == identity:
                how = " (a hard link)"
            else:
                continue
            _fail(setting, value, f"{head}is the {label} file {given}{how}")
        for label, given, resolved, identity in dirs:
            ancestors = [real, *real.parents]
            inside = resolved in ancestors or (
                identity is not None and identity in map(_identity, ancestors)
            )
            if inside:
                where = "is" if resolved == real else "lies inside"
                _fail(setting, value, f"{head}{where} the {label} directory {given}")
