"""Several arrays as one buffer of 32-bit words per row, and back, by bit casts.

An encoding (int8 codes and their float32 scales, top-k indices and values) travels in one
collective (:func:`co2jax.comm.reducer.all_gather_tree`, :func:`co2jax.comm.staged.
exchange_tree`): XLA:TPU keeps one asynchronous collective in flight under an inner step, and
an encoding's second array gathered on its own was synchronous. :func:`pack_rows` casts row i
of every array to 32-bit words and lays them side by side; :func:`unpack_rows` gives back
exactly the same values.

Example:
  >>> import jax.numpy as jnp
  >>> q = jnp.array([[1, -2, 3, 4]], jnp.int8)  # one row of 4 int8: one word
  >>> s = jnp.array([[0.5]])                    # one row of one float32: one word
  >>> words = pack_rows([q, s])
  >>> words.shape, [x.tolist() for x in unpack_rows(words, [q[0], s[0]])]
  ((1, 2, 1), [[[1, -2, 3, 4]], [[0.5]]])
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

_WORDS = 128
"""Row width (32-bit words) of :func:`all_gather_tree`'s packed buffer."""


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x``'s bytes as a flat ``uint8`` vector (exact: a bit cast)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of :func:`_as_bytes` for each of the leading dims of ``b`` (``[R, n]``)."""
    dtype = jnp.uint8 if like.dtype == jnp.bool_ else like.dtype
    size = jnp.dtype(dtype).itemsize
    shaped = b.reshape(b.shape[0], *like.shape, *((size,) if size > 1 else ()))
    out = jax.lax.bitcast_convert_type(shaped, dtype)
    return out.astype(jnp.bool_) if like.dtype == jnp.bool_ else out


def _word_axis(like: Any) -> tuple[int, int]:
    """How one row of ``like`` (an array or ``ShapeDtypeStruct``) is cast to 32-bit words:
    ``(per, axis)``, ``per`` elements a word grouped along ``axis`` (-2: consecutive rows, as
    XLA:TPU packs 1- and 2-byte types in its tiles; -1: consecutive elements), ``(1, 0)``
    for 4-byte elements, ``(0, 0)`` when neither axis holds whole words (cast through the
    bytes)."""
    dtype = jnp.uint8 if like.dtype == jnp.bool_ else jnp.dtype(like.dtype)
    size = jnp.dtype(dtype).itemsize
    if size == 4:
        return 1, 0
    per = 4 // size if size < 4 else 0
    if per and len(like.shape) >= 2 and like.shape[-2] % per == 0:
        return per, -2
    if per and len(like.shape) >= 1 and like.shape[-1] % per == 0:
        return per, -1
    return 0, 0


def _word_count(like: Any) -> int:
    """32-bit words of one row of ``like`` in :func:`pack_rows`' buffer."""
    n = math.prod(like.shape)
    per, _ = _word_axis(like)
    return n // per if per else -(-n * jnp.dtype(like.dtype).itemsize // 4)


def _as_words(x: jax.Array) -> jax.Array:
    """Row i of ``x`` (``[r, ...]``) as ``[r, words]`` uint32, a bit cast (:func:`_word_axis`;
    through the bytes, zero-padded to a word, where no axis holds whole words)."""
    r = x.shape[0]
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    per, axis = _word_axis(jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    if per == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(r, -1)
    if per and axis == -2:  # [..., m, L] -> [..., m / per, L, per]: rows into a word
        grouped = x.reshape(*x.shape[:-2], x.shape[-2] // per, per, x.shape[-1])
        grouped = jnp.swapaxes(grouped, -1, -2)
        return jax.lax.bitcast_convert_type(grouped, jnp.uint32).reshape(r, -1)
    if per:
        grouped = x.reshape(*x.shape[:-1], x.shape[-1] // per, per)
        return jax.lax.bitcast_convert_type(grouped, jnp.uint32).reshape(r, -1)
    b = _as_bytes(x).reshape(r, -1)
    b = jnp.pad(b, ((0, 0), (0, (-b.shape[1]) % 4)))
    return jax.lax.bitcast_convert_type(b.reshape(r, -1, 4), jnp.uint32)


def _from_words(w: jax.Array, like: Any) -> jax.Array:
    """The inverse of :func:`_as_words`: ``[r, words]`` to ``[r, *like.shape]``."""
    r, (per, axis) = w.shape[0], _word_axis(like)
    dtype = jnp.uint8 if like.dtype == jnp.bool_ else like.dtype
    shape = tuple(like.shape)
    if per == 1:
        out = jax.lax.bitcast_convert_type(w.reshape(r, *shape), dtype)
    elif per and axis == -2:
        words = w.reshape(r, *shape[:-2], shape[-2] // per, shape[-1])
        out = jnp.swapaxes(jax.lax.bitcast_convert_type(words, dtype), -1, -2)
        out = out.reshape(r, *shape)
    elif per:
        words = w.reshape(r, *shape[:-1], shape[-1] // per)
        out = jax.lax.bitcast_convert_type(words, dtype).reshape(r, *shape)
    else:
        size = math.prod(shape) * jnp.dtype(like.dtype).itemsize
        data = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(r, -1)[:, :size]
        return _from_bytes(data, like)
    return out.astype(jnp.bool_) if like.dtype == jnp.bool_ else out


def _row_words(likes: list) -> int:
    """The row width of :func:`pack_rows`' buffer for leaves ``likes`` (one row of each):
    128 words once the buffer holds 100 such rows, else 1."""
    return _WORDS if sum(_word_count(x) for x in likes) >= 100 * _WORDS else 1


def pack_rows(leaves: list) -> jax.Array:
    """Row i of every leaf (each ``[r, ...]``) as one buffer of 32-bit words, ``[r, ...]``:
    a bit cast, so :func:`unpack_rows` gives back exactly the same values. In rows of 128
    words once the buffer holds 100 of them (the layout of a float32 array's tiles: a flat
    byte vector was gathered by XLA:TPU as a synchronous all-reduce of a zero-padded
    buffer), each leaf starting on a row, else in rows of one word.

    Each leaf is cast to words in place (:func:`_word_axis`: int8 codes four rows to a
    word, as XLA:TPU packs them; float32 scales as they are) and padded to whole rows: cast
    through one flat byte vector, as every leaf was before, the pack and unpack of an int8
    encoding of 25M values cost XLA:TPU 14 CPU-s of compile and 0.8 GiB of temporaries
    (``docs/overlap.md``). A leaf with no axis of whole words goes through its bytes."""
    r = leaves[0].shape[0]
    row = _row_words([jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves])
    parts = []
    for x in leaves:
        w = _as_words(x)
        w = jnp.pad(w, ((0, 0), (0, (-w.shape[1]) % row)))
        parts.append(w.reshape(r, -1, row))
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def unpack_rows(words: jax.Array, likes: list) -> list:
    """The leaves of :func:`pack_rows` from its ``[r, ...]`` words, each ``[r, *like.shape]``
    (``likes``: one row of each leaf, arrays or ``ShapeDtypeStruct`` s)."""
    r, row = words.shape[0], _row_words(likes)
    rows = words.reshape(r, -1, row)
    out, offset = [], 0
    for like in likes:
        n = _word_count(like)
        k = -(-n // row)
        w = rows[:, offset : offset + k].reshape(r, -1)[:, :n]
        out.append(_from_words(w, like))
        offset += k
    return out
