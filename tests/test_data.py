"""experiments.data: Markov entropy, corpora loading, deterministic per-replica streams."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest

from experiments import data

# --- Markov source ---------------------------------------------------------------------------


def test_markov_empirical_entropy_matches_entropy_rate():
    src = data.MarkovSource(vocab_size=64, branching=8, seed=3)
    seqs = src.sample(np.random.default_rng(0), batch=200, length=1001)  # 200k transitions
    nll = -src.log_prob(seqs)
    assert np.isfinite(nll).all()
    assert nll.mean() == pytest.approx(src.entropy_rate, rel=0.01)
    assert 0 < src.entropy_rate < np.log(8)


def test_markov_transition_frequencies_and_stationary_start():
    src = data.MarkovSource(vocab_size=8, branching=3, seed=1, temperature=0.7)
    p = src.dense()
    np.testing.assert_allclose(p.sum(1), 1.0)
    assert ((p > 0).sum(1) == 3).all()
    np.testing.assert_allclose(src.stationary @ p, src.stationary, atol=1e-12)
    seqs = src.sample(np.random.default_rng(1), batch=100, length=2001)
    counts = np.bincount((seqs[:, :-1] * 8 + seqs[:, 1:]).ravel(), minlength=64).reshape(8, 8)
    visits = counts.sum(1, keepdims=True)
    assert (counts[p == 0] == 0).all() and visits.min() > 100
    z = np.abs(counts / visits - p) / np.sqrt(p * (1 - p) / visits + 1e-12)
    assert z.max() < 5.0  # per-row binomial standard errors (rows are visited unevenly)
    first = np.bincount(src.sample(np.random.default_rng(2), 20000, 1)[:, 0], minlength=8)
    np.testing.assert_allclose(first / 20000, src.stationary, atol=0.015)


@pytest.mark.parametrize("vocab,branching", [(3000, 4), (3000, 2), (50, 50)])
def test_markov_stationary_solvers(vocab, branching):
    src = data.MarkovSource(vocab_size=vocab, branching=branching, seed=0)
    pi = src.stationary
    step = np.bincount(src.successors.ravel(), (pi[:, None] * src.probs).ravel(), minlength=vocab)
    np.testing.assert_allclose(step, pi, rtol=1e-8, atol=1e-14)
    assert (src.successors[:, 0] == np.arange(vocab)).all()
    assert all(len(set(row)) == branching for row in src.successors[:50].tolist())


def test_markov_temperature_lowers_entropy():
    hot = data.MarkovSource(32, 4, seed=0, temperature=2.0).entropy_rate
    cold = data.MarkovSource(32, 4, seed=0, temperature=0.3).entropy_rate
    assert cold < hot < np.log(4)


# --- corpora ---------------------------------------------------------------------------------


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    # UTF-8 text, multi-byte characters included (kind=text skips files that are not text)
    contents = {"a.txt": b"hello world\n", "b.txt": "ünï ✓ €\n".encode(), "sub/c.txt": b"z"}
    for name, blob in contents.items():
        (d / name).write_bytes(blob)
    (d / ".hidden").write_bytes(b"secret")
    return d, contents


def test_byte_text_round_trip_and_forms(text_dir):
    d, c = text_dir
    single = data.ByteText(d / "a.txt")
    assert single.tokens.tobytes() == c["a.txt"] and single.vocab_size == 256
    listed = data.ByteText([d / "b.txt", str(d / "a.txt")])
    assert listed.tokens.tobytes() == c["b.txt"] + c["a.txt"]
    whole = data.ByteText(d)  # directory: recursive, sorted, hidden files skipped
    assert whole.tokens.tobytes() == c["a.txt"] + c["b.txt"] + c["sub/c.txt"]
    assert data.ByteText(str(d / "*.txt")).tokens.tobytes() == c["a.txt"] + c["b.txt"]
    assert len(data.ByteText(str(d / "**" / "*.txt"))) == len(whole)
    assert data.ByteText(d, max_bytes=5).tokens.tobytes() == b"hello"


def test_byte_text_errors_name_the_path(text_dir, tmp_path):
    d, _ = text_dir
    for bad in (str(d / "*.nothing"), str(tmp_path / "missing.txt")):
        with pytest.raises(ValueError, match=r"path=.*matches no file") as e:
            data.ByteText(bad)
        assert bad in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        data.ByteText(tmp_path / "empty")
    (tmp_path / "zero.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        data.ByteText(tmp_path / "zero.txt")


def test_stdlib_corpus_deterministic_and_capped():
    cap = 1_000_000
    files = data.stdlib_corpus(max_bytes=cap)
    assert files and files == data.stdlib_corpus(max_bytes=cap)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert sum(f.stat().st_size for f in files) <= cap
    text = data.ByteText(files, max_bytes=cap)
    assert 0 < len(text) <= cap and text.tokens.dtype == np.uint8
    assert b"def " in text.tokens[:200_000].tobytes()


@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 70000)])
def test_token_file_round_trip(tmp_path, dtype, top):
    ids = np.random.default_rng(0).integers(0, top, 5000).astype(dtype)
    ids[7] = top - 1
    path = tmp_path / "toks.bin"
    ids.tofile(path)
    tf = data.TokenFile(path, dtype=dtype)
    assert isinstance(tf.tokens, np.memmap) and tf.tokens.dtype == dtype
    np.testing.assert_array_equal(tf.tokens, ids)
    assert tf.vocab_size == top and len(tf) == 5000
    assert data.TokenFile(path, dtype, vocab_size=top + 10).vocab_size == top + 10


def test_token_file_errors(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="itemsize"):
        data.TokenFile(path, "uint16")
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="dtype='int8'"):
        data.TokenFile(path, "int8")
    with pytest.raises(ValueError, match="vocab_size=5"):
        data.TokenFile(path, "uint16", vocab_size=5)
    with pytest.raises(ValueError, match="path="):
        data.TokenFile(tmp_path / "nope.bin")


# --- replica streams -------------------------------------------------------------------------


def _ramp(n):  # token t at position t: a window reveals its offset
    return data.Corpus(np.arange(n, dtype=np.uint32))


def test_markov_streams_shape_determinism_and_replicas():
    kw = dict(replicas=3, batch=4, seq_len=16, steps_per_round=5)
    s = data.make_streams("markov", vocab_size=32, branching=4, seed=7, **kw)
    x = s.round_batch(2)
    assert x.shape == (3, 5, 4, 17) == s.shape and x.dtype == np.int32
    assert 0 <= x.min() and x.max() < s.vocab_size == 32
    again = data.make_streams({"kind": "markov", "vocab_size": 32, "branching": 4, "seed": 7}, **kw)
    np.testing.assert_array_equal(again.round_batch(2), x)
    assert not np.array_equal(s.round_batch(3), x)
    assert not np.array_equal(data.make_streams("markov", seed=8, **kw).round_batch(2)[0], x[0])
    assert not np.array_equal(x[0], x[1]) and not np.array_equal(x[1], x[2])
    assert s.entropy_rate == s.sources[0].entropy_rate
    k, first = next(s.rounds(start=2))
    assert k == 2 and np.array_equal(first, x)


def test_markov_non_iid_replicas_use_different_chains():
    s = data.make_streams(
        "markov",
        vocab_size=64,
        branching=4,
        iid=False,
        replicas=3,
        batch=8,
        seq_len=32,
        steps_per_round=2,
    )
    assert len(s.sources) == 3
    x = s.round_batch(0)
    for r in range(3):
        for q in range(3):
            possible = np.isfinite(s.sources[q].log_prob(x[r])).all()
            assert possible == (q == r)
    assert s.entropy_rate == pytest.approx(np.mean([src.entropy_rate for src in s.sources]))
    ev = s.eval_batch(6)
    assert np.isfinite(s.sources[1].log_prob(ev[[1, 4]])).all()
    with pytest.raises(ValueError, match="sources"):
        data.ReplicaStreams(s.sources[0], 2, 1, 4, 1, iid=False)


def test_corpus_streams_iid_windows_and_held_out_tail():
    n = 10_000
    s = data.ReplicaStreams(_ramp(n), replicas=4, batch=8, seq_len=31, steps_per_round=3, seed=1)
    assert s.entropy_rate is None and s.vocab_size == n
    x = s.round_batch(0)
    assert x.shape == (4, 3, 8, 32) and x.dtype == np.int32
    assert (np.diff(x, axis=-1) == 1).all()  # contiguous windows
    tail = n - 500
    assert x[..., -1].max() < tail  # training never reads the held-out tail
    assert all(not np.array_equal(x[r], x[q]) for r in range(4) for q in range(r))
    np.testing.assert_array_equal(s.round_batch(0), x)
    ev = s.eval_batch(64)
    assert ev.shape == (64, 32) and ev.min() >= tail and (np.diff(ev, axis=-1) == 1).all()
    np.testing.assert_array_equal(ev, s.eval_batch(64))
    assert not np.array_equal(ev, s.eval_batch(64, seed=9))


def test_corpus_streams_non_iid_disjoint_shards():
    n, r_ = 10_000, 4
    s = data.ReplicaStreams(_ramp(n), r_, 8, 15, 4, seed=0, iid=False)
    x = s.round_batch(5)
    cut = n - 500
    for r in range(r_):
        lo, hi = round(r * cut / r_), round((r + 1) * cut / r_)
        assert lo <= x[r].min() and x[r].max() < hi


def test_corpus_streams_several_sources(tmp_path):
    a, b = data.Corpus(np.zeros(1000, np.int64) + 1), data.Corpus(np.zeros(1000, np.int64) + 2)
    iid = data.ReplicaStreams([a, b], 2, 16, 7, 2, seed=0).round_batch(0)
    assert set(np.unique(iid[0])) == {1, 2}  # a mixture within each replica
    non = data.ReplicaStreams([a, b], 3, 16, 7, 2, seed=0, iid=False).round_batch(0)
    assert [set(np.unique(non[r])) for r in range(3)] == [{1}, {2}, {1}]


def test_file_backed_streams(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    s = data.make_streams(
        "tokens", path=str(path), replicas=2, batch=2, seq_len=8, steps_per_round=2
    )
    assert s.vocab_size == 4000 and (np.diff(s.round_batch(1), axis=-1) == 1).all()
    (tmp_path / "a.txt").write_bytes(b"abcdefgh" * 200)
    t = data.make_streams(
        "text", path=str(tmp_path / "*.txt"), replicas=2, batch=2, seq_len=8, steps_per_round=1
    )
    assert t.vocab_size == 256 and set(np.unique(t.round_batch(0))) <= set(b"abcdefgh")
    st = data.make_streams(
        "stdlib", max_bytes=300_000, replicas=2, batch=2, seq_len=64, steps_per_round=2, iid=False
    )
    assert st.round_batch(0).shape == (2, 2, 2, 65)


def test_markov_round_is_fast():
    s = data.make_streams(
        "markov", vocab_size=256, branching=8, replicas=4, batch=16, seq_len=128, steps_per_round=16
    )
    t0 = time.perf_counter()
    assert s.round_batch(0).shape == (4, 16, 16, 129)
    assert time.perf_counter() - t0 < 5.0


def test_accepts_the_run_config():
    config = pytest.importorskip("experiments.config")
    cfg = dataclasses.asdict(config.preset("micro").data)
    s = data.make_streams(cfg, replicas=2, steps_per_round=2)
    assert s.shape == (2, 2, cfg["batch"], cfg["seq_len"] + 1)


# --- bad input -------------------------------------------------------------------------------

_OK = dict(replicas=2, batch=2, seq_len=8, steps_per_round=2)


@pytest.mark.parametrize(
    "kind,changes,field",
    [
        ("nope", {}, "kind"),
        ("markov", {"seq_len": 0}, "seq_len"),
        ("markov", {"batch": 0}, "batch"),
        ("markov", {"replicas": 0}, "replicas"),
        ("markov", {"steps_per_round": 1.5}, "steps_per_round"),
        ("markov", {"seed": -1}, "seed"),
        ("markov", {"branching": 100}, "branching"),
        ("markov", {"temperature": 0.0}, "temperature"),
        ("markov", {"eval_fraction": 1.0}, "eval_fraction"),
        ("markov", {"bogus": 1}, "bogus"),
        ("text", {}, "path"),
        ("tokens", {"path": None}, "path"),
        ("tokens", {"path": "x.bin", "token_dtype": "int8"}, "token_dtype"),
        ("stdlib", {"vocab_size": 64}, "vocab_size"),
    ],
)
def test_bad_inputs_name_the_field(kind, changes, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        data.make_streams(kind, **(_OK | changes))


def test_missing_required_and_short_corpus(tmp_path):
    with pytest.raises(ValueError, match=r"^steps_per_round"):
        data.make_streams("markov", replicas=2)
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"^seq_len=64.*100 tokens"):
        data.make_streams("text", path=str(tmp_path / "short.txt"), **(_OK | {"seq_len": 64}))
    with pytest.raises(ValueError, match=r"^seq_len"):
        data.ReplicaStreams(_ramp(200), 8, 1, 30, 1, iid=False)  # shards too short
    s = data.make_streams("markov", **_OK)
    with pytest.raises(ValueError, match=r"^round_index"):
        s.round_batch(-1)
    with pytest.raises(ValueError, match=r"^sources"):
        data.ReplicaStreams([data.MarkovSource(4, 2), _ramp(100)], 1, 1, 4, 1)


# --- the Grain pipeline ------------------------------------------------------------------------


def _window_index(r, k, h, row, R, H, B, D):
    """Where window (replica r, round k, step h, batch row) sits in its pool's dealt order:
    shard d = row // b reads positions r + R (d + D n), n = (k H + h) b + row % b."""
    b = B // D
    n = (k * H + h) * b + row % b
    return r + R * (row // b + D * n)


@pytest.mark.parametrize("D", [1, 2])
def test_corpus_epoch_is_a_permutation_dealt_to_disjoint_replicas(D):
    R, H, B, L, n = 3, 2, 4, 5, 1201  # 1140 training tokens: 227 windows, not a multiple of R B
    s = data.ReplicaStreams(_ramp(n), R, B, L, H, seed=3, data_shards=D)
    windows = (n - math.ceil(0.05 * n) - 1) // L
    seen = {}
    for k in range(windows // (R * H * B) + 2):
        x = s.round_batch(k)
        for r, h, row in np.ndindex(R, H, B):
            seen[_window_index(r, k, h, row, R, H, B, D)] = x[r, h, row]
    first = [seen[i] for i in range(windows)]  # one epoch, across replicas and shards
    assert all((np.diff(w) == 1).all() for w in first)
    starts = sorted(int(w[0]) for w in first)
    assert starts == [L * i for i in range(windows)]  # every window once: a permutation
    order = [int(w[0]) for w in first]
    assert order != starts  # shuffled
    second = [int(seen[i][0]) for i in range(windows, min(len(seen), 2 * windows))]
    assert len(second) > 10 and second != order[: len(second)]  # each epoch reshuffled


def test_a_replicas_windows_do_not_depend_on_the_data_shards():
    one = data.ReplicaStreams(_ramp(5000), 2, 8, 7, 3, seed=1, data_shards=1)
    four = data.ReplicaStreams(_ramp(5000), 2, 8, 7, 3, seed=1, data_shards=4)
    for k in range(3):
        a, b = one.round_batch(k), four.round_batch(k)
        assert not np.array_equal(a, b)  # rows are dealt to the shards in another order
        for r, h in np.ndindex(2, 3):
            np.testing.assert_array_equal(np.sort(a[r, h, :, 0]), np.sort(b[r, h, :, 0]))
    other = data.ReplicaStreams(_ramp(5000), 2, 8, 7, 3, seed=2, data_shards=1)
    assert not np.array_equal(np.sort(other.round_batch(0)[0, 0, :, 0]), np.sort(a[0, 0, :, 0]))


def test_markov_rounds_follow_the_stream_rule_at_any_data_shards():
    """Replica r of round k is ``MarkovSource.sample(default_rng([seed, 0, k, r]), H B, L + 1)``
    (one iid source), bitwise, whatever the data shards."""
    src = data.MarkovSource(48, 4, seed=5)
    R, H, B, L, seed = 3, 2, 6, 9, 11
    for D in (1, 2, 3):
        s = data.ReplicaStreams(src, R, B, L, H, seed=seed, data_shards=D)
        for k in (0, 4):
            x = s.round_batch(k)
            for r in range(R):
                want = src.sample(np.random.default_rng([seed, 0, k, r]), H * B, L + 1)
                np.testing.assert_array_equal(x[r], want.reshape(H, B, L + 1))


@pytest.mark.parametrize("kind", ["markov", "corpus"])
def test_the_iterator_state_resumes_at_the_next_round(kind):
    src = data.MarkovSource(32, 4) if kind == "markov" else _ramp(3000)
    s = data.ReplicaStreams(src, 4, 4, 8, 2, seed=0, data_shards=2)
    it = s.iterator()
    got = [next(it) for _ in range(3)]
    state = it.get_state()
    assert state == {"next_index": 3}
    later = next(it)
    again = s.iterator()
    again.set_state(state)
    np.testing.assert_array_equal(next(again), later)
    for k, x in enumerate(got):
        np.testing.assert_array_equal(x, s.round_batch(k))
    k, x = next(s.rounds(start=5))
    assert k == 5 and np.array_equal(x, s.round_batch(5))
    for i in (it, again):
        i.close()


def test_a_checkpoint_keeps_the_iterator_state(tmp_path):
    import jax.numpy as jnp

    from experiments.checkpoints import Checkpoints

    s = data.ReplicaStreams(_ramp(3000), 2, 4, 8, 2, seed=0, data_shards=2)
    ckpt = Checkpoints(tmp_path, keep=3)
    it = s.iterator()
    ckpt.save(1, {"w": jnp.ones(2)})  # a checkpoint without the data (an older run's)
    next(it), next(it)
    ckpt.save(2, {"w": jnp.ones(2)}, data=it)
    fresh = s.iterator()
    assert not ckpt.restore_data(1, fresh) and fresh.get_state() == {"next_index": 0}
    assert ckpt.restore_data(2, fresh) and fresh.get_state() == {"next_index": 2}
    np.testing.assert_array_equal(next(fresh), s.round_batch(2))
    ckpt.close()
    it.close(), fresh.close()


def test_the_data_shards_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"^batch=6: must be a multiple of data_shards=4"):
        data.make_streams("markov", **(_OK | {"batch": 6, "data_shards": 4}))
    with pytest.raises(ValueError, match=r"^data_shards=0"):
        data.make_streams("markov", **(_OK | {"data_shards": 0}))
