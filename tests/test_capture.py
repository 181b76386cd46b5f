"""Capture into zarr stores: chunking, sampling, basis, round trip, resume and crash safety."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore, QuerySampling, SequenceBatch
from dsaindex.geometry import geometry_from_config
from dsaindex.pipelines.capture.corpus import CorpusSpec
from dsaindex.pipelines.capture.run import SequenceCapturer, capture, sample_query_positions
from dsaindex.quant import hadamard_matrix
from dsaindex.score import indexer_scores
from helpers import PRESETS, text_corpus


def corpus_dir(tmp_path, n_files=3, size=3000):
    return text_corpus(tmp_path, n_files, size // 5, seed=0)


def run_sequence(loaded, tokens, chunk_len, basis="raw", key_dtype="float32", sampling=None):
    sampling = sampling or QuerySampling(scattered=12, windows=1, window_len=6)
    settings = CaptureSettings(seq_len=len(tokens), chunk_len=chunk_len, basis=basis, key_dtype=key_dtype,
                               sampling=sampling)
    batch = SequenceBatch()
    with SequenceCapturer(loaded, settings, "cpu") as capturer:
        capturer.run(tokens, 0, batch)
    return batch


def dense_copy(loaded):
    """The model with top-k above the sequence length: selection keeps every causal key, so results
    cannot hinge on how exact score ties (relu zeros) are broken."""
    import copy

    dense = copy.copy(loaded)
    dense.model = copy.deepcopy(loaded.model)
    for module in dense.model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = 1 << 20
    return dense


@pytest.mark.parametrize("ref", PRESETS)
def test_chunked_capture_equals_one_pass(loaded_models, ref):
    """Long sequences run in chunks through the KV cache; the keys and queries must not change."""
    loaded = dense_copy(loaded_models[ref])
    tokens = torch.randint(0, 256, (203,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = run_sequence(loaded, tokens, chunk_len=1000)
    chunked = run_sequence(loaded, tokens, chunk_len=48)
    assert whole.query_position[0].tolist() == chunked.query_position[0].tolist()
    for layer in geometry_from_config(loaded.model.config).indexer_layers:
        a, b = whole.keys[layer][0], chunked.keys[layer][0]
        assert a.shape == b.shape and a.shape[0] == geometry_from_config(loaded.model.config).keys_for_tokens(203)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(whole.queries[layer][0], chunked.queries[layer][0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(whole.head_weights[layer][0], chunked.head_weights[layer][0], rtol=1e-4, atol=1e-5)


def test_query_sampling_is_deterministic_with_decode_windows():
    s = QuerySampling(scattered=20, windows=3, window_len=8, seed=7)
    pos, win = sample_query_positions(1000, 5, s)
    pos2, win2 = sample_query_positions(1000, 5, s)
    assert pos.tolist() == pos2.tolist() and win.tolist() == win2.tolist()
    assert pos.tolist() != sample_query_positions(1000, 6, s)[0].tolist()
    assert pos.tolist() == sorted(set(pos.tolist())) and pos.min() >= 0 and pos.max() < 1000
    for w in range(3):  # each window is a run of consecutive positions in the second half
        members = pos[win == w]
        assert len(members) >= 1 and members.min() >= 500
        assert np.all(np.diff(members) == 1)
    assert (win == -1).sum() >= 10


def test_store_roundtrip_and_hadamard_basis(loaded_models, tmp_path):
    """Stored keys equal what the model scores (in the chosen basis) and give the same scores."""
    loaded = loaded_models["preset:tiny-v32"]
    settings = CaptureSettings(seq_len=160, chunk_len=64, basis="hadamard", key_dtype="bfloat16")
    result = capture(tmp_path / "s", loaded.ref, CorpusSpec((str(corpus_dir(tmp_path)),)), settings, 3,
                     flush_tokens=200, loaded=loaded)
    assert result.sequences_added == 3 and result.tokens_added == 480
    store = CaptureStore.open(tmp_path / "s")
    assert store.committed.sequences == 3 and store.committed.keys == 480
    tokens = store.array("tokens")[:160].tolist()
    raw = run_sequence(loaded, tokens, chunk_len=64, basis="raw", key_dtype="float32", sampling=settings.sampling)
    positions = store.array("query_position")
    seq_of = store.array("query_sequence")
    first = seq_of == 0
    assert positions[first].tolist() == sample_query_positions(160, 0, settings.sampling)[0].tolist()
    for layer in store.layers:
        keys_h = store.as_float(store.keys(layer)[:160])
        q_h = store.as_float(store.queries(layer)[first])
        w = torch.from_numpy(store.head_weights(layer)[first])
        keys_raw = torch.from_numpy(raw.keys[layer][0])
        q_raw = torch.from_numpy(raw.queries[layer][0])
        # the stored basis is Hadamard: rotating back gives the raw keys (to bf16 precision)
        h = hadamard_matrix(128)
        torch.testing.assert_close(keys_h @ h.t(), keys_raw, rtol=0.02, atol=0.02)
        # scores from the stored (rotated, bf16) tensors match the raw fp32 ones
        s_stored = indexer_scores(q_h, keys_h, w)
        s_raw = indexer_scores(q_raw, keys_raw, torch.from_numpy(raw.head_weights[layer][0]))
        torch.testing.assert_close(s_stored, s_raw, rtol=0.03, atol=0.03 * float(s_raw.abs().max()))
    info = store.info()
    assert info["committed"]["queries"] == len(positions) and info["basis"] == "hadamard"


def test_resume_extends_to_the_same_store(loaded_models, tmp_path):
    loaded = loaded_models["preset:tiny-v4"]
    spec = CorpusSpec((str(corpus_dir(tmp_path)),))
    settings = CaptureSettings(seq_len=128, chunk_len=48)
    capture(tmp_path / "once", loaded.ref, spec, settings, 4, flush_tokens=1, loaded=loaded)
    capture(tmp_path / "twice", loaded.ref, spec, settings, 2, flush_tokens=1, loaded=loaded)
    again = capture(tmp_path / "twice", loaded.ref, spec, settings, 4, flush_tokens=1, loaded=loaded)
    assert again.resumed_from == 2 and again.sequences_added == 2
    assert_same_store(tmp_path / "once", tmp_path / "twice")


def test_ctrl_c_commits_the_whole_sequences_of_a_batch(loaded_models, tmp_path):
    """With batched commits (--flush-tokens), a Ctrl-C still commits the sequences captured before it; the
    resumed store equals an uninterrupted one."""
    loaded = loaded_models["preset:tiny-v32"]
    spec = CorpusSpec((str(corpus_dir(tmp_path)),))
    settings = CaptureSettings(seq_len=128, chunk_len=48)
    capture(tmp_path / "once", loaded.ref, spec, settings, 4, loaded=loaded)

    def interrupt_in_third_sequence(done, total):
        if done > 2 * settings.seq_len:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(tmp_path / "cut", loaded.ref, spec, settings, 4, flush_tokens=1 << 20, loaded=loaded,
                progress=interrupt_in_third_sequence)
    assert CaptureStore.open(tmp_path / "cut").committed.sequences == 2
    again = capture(tmp_path / "cut", loaded.ref, spec, settings, 4, loaded=loaded)
    assert again.resumed_from == 2 and again.sequences_added == 2
    assert_same_store(tmp_path / "once", tmp_path / "cut")


def assert_same_store(a, b):
    sa, sb = CaptureStore.open(a), CaptureStore.open(b)
    assert sa.committed == sb.committed
    for name in ("tokens", "sequence_tokens", "sequence_keys", "query_position", "query_sequence", "query_window"):
        np.testing.assert_array_equal(sa.array(name), sb.array(name))
    for layer in sa.layers:
        np.testing.assert_array_equal(sa.keys(layer), sb.keys(layer))
        np.testing.assert_array_equal(sa.queries(layer), sb.queries(layer))
        np.testing.assert_array_equal(sa.head_weights(layer), sb.head_weights(layer))


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    """A capture killed with SIGKILL mid-run and run again gives the same store as an uninterrupted run."""
    corpus = corpus_dir(tmp_path, n_files=4, size=6000)
    args = ["capture", "--model", "preset:tiny-v32", "--corpus", str(corpus), "--sequences", "10",
            "--seq-len", "256", "--chunk-len", "128", "--flush-tokens", "256", "--no-progress", "--json"]
    # one thread: a multi-threaded CPU forward may sum in another order when the machine is busy, and the two
    # runs would differ in the last bit of a few keys
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ref = subprocess.run([sys.executable, "-m", "dsaindex", *args[:1], str(tmp_path / "ref"), *args[1:]],
                         capture_output=True, text=True, env=env, timeout=300)
    assert ref.returncode == 0, ref.stderr
    assert json.loads(ref.stdout)["store"]["committed"]["sequences"] == 10

    target = tmp_path / "killed"
    # the capture kills itself (SIGKILL) at the worst moment: the 4th sequence's rows written, not yet committed
    killer = textwrap.dedent("""
        import os, signal, sys
        from dsaindex.artifacts.capture_store import CaptureStore
        from dsaindex.cli import main

        commit = CaptureStore._write_attrs

        def write_attrs(self):
            if self.committed.sequences == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(self)

        CaptureStore._write_attrs = write_attrs
        sys.argv = ["dsaindex", *sys.argv[1:]]
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", killer, args[0], str(target), *args[1:]],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed_at = CaptureStore.open(target).committed.sequences
    assert killed_at == 3

    resumed = subprocess.run([sys.executable, "-m", "dsaindex", args[0], str(target), *args[1:]],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    out = json.loads(resumed.stdout)
    assert out["capture"]["resumed_from"] == killed_at
    assert_same_store(tmp_path / "ref", target)
    assert not list(target.rglob("*.partial"))


def test_a_corpus_that_ends_inside_a_sequence_is_said(tmp_path):
    """Two files of 600 words are under two 4,096-byte sequences: the second is the shorter remainder, captured
    as it is, and the command says so instead of passing it off as a full sequence."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from helpers import run_cli, text_corpus

    corpus = text_corpus(tmp_path)
    proc = run_cli("capture", str(tmp_path / "s"), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "3",
                   "--seq-len", "4096", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    tokens = CaptureStore.open(tmp_path / "s").array("sequence_tokens").tolist()
    assert tokens[0] == 4096 and 16 <= tokens[-1] < 4096
    assert f"the corpus ends within sequence {len(tokens) - 1}: it holds {tokens[-1]:,} tokens, not 4,096" in proc.stderr
