"""Indexer-only distillation for a reuse plan: only the kept indexers move, the union KL falls, the plan's
quality is measured as served, and the overlay loads onto its own checkpoint only."""

import json

import pytest
import torch

from helpers import run_cli, v2_corpus

TOPK = 16


@pytest.fixture(scope="module")
def reference():
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.pipelines.capture.tokens import build_token_streams, heldout_windows

    loaded = load_model("reference-v1", dtype="float32")
    set_index_topk(loaded.model, TOPK)
    streams = build_token_streams(400_000, 100_000)
    ids, labels = heldout_windows(torch.from_numpy(streams.heldout), 96, 2)
    return loaded, torch.from_numpy(streams.train), ids, labels


def test_distillation_moves_only_the_kept_indexers_and_lowers_the_union_kl(reference):
    from dsaindex.pipelines.capture.indexer_distill import distill, distill_loss

    loaded, train, ids, _ = reference
    net = loaded.model
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    sources = [0, 0, 2, 2]  # layers 0 and 2 keep their indexer; 1 and 3 reuse them
    g = torch.Generator().manual_seed(5)
    from dsaindex.pipelines.capture.tokens import sample_windows

    probe, _ = sample_windows(train, 2, 96, g)
    with torch.no_grad():
        kl0 = float(distill_loss(net, probe, sources))
    history = distill(net, sources, train, steps=12, batch=2, seq_len=96, lr=3e-3)
    with torch.no_grad():
        kl1 = float(distill_loss(net, probe, sources))
    assert len(history) == 12 and kl1 < kl0
    moved = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".indexer." in n and n.startswith(("model.layers.0.", "model.layers.2.")) for n in moved)
    assert all(not p.requires_grad for p in net.parameters())
    with torch.no_grad():  # leave the shared fixture as it was
        for n, p in net.named_parameters():
            p.copy_(before[n])


def test_the_selected_objective_targets_the_served_layers_own_top_k(reference):
    """``selected``: the target is the served layers' attention on the union of their own top-k only; it
    trains (the loss falls) and differs from the dense target's loss."""
    from dsaindex.pipelines.capture.indexer_distill import distill, distill_loss
    from dsaindex.pipelines.capture.tokens import sample_windows

    loaded, train, _, _ = reference
    net = loaded.model
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    probe, _ = sample_windows(train, 1, 96, torch.Generator().manual_seed(7))
    with torch.no_grad():
        dense = float(distill_loss(net, probe, [0, 0, 0, 0]))
        kl0 = float(distill_loss(net, probe, [0, 0, 0, 0], "selected", TOPK))
    assert kl0 != dense
    distill(net, [0, 0, 0, 0], train, steps=10, batch=2, seq_len=96, lr=3e-3, objective="selected", topk=TOPK)
    with torch.no_grad():
        assert float(distill_loss(net, probe, [0, 0, 0, 0], "selected", TOPK)) < kl0
        for n, p in net.named_parameters():
            p.copy_(before[n])
    with pytest.raises(ValueError, match="objective"):
        distill_loss(net, probe, [0, 0, 0, 0], "sparse")


def test_plan_quality_attends_the_source_layers_selection(reference):
    from dsaindex.pipelines.capture.indexer_distill import plan_forward_loss, plan_quality

    loaded, _, ids, labels = reference
    net = loaded.model
    own = plan_quality(net, ids, labels, [0, 1, 2, 3], TOPK)
    assert own["retained_recall"] == [1.0, 1.0, 1.0, 1.0]
    shared = plan_quality(net, ids, labels, [0, 0, 0, 0], TOPK)
    assert shared["retained_recall"][0] == 1.0 and min(shared["retained_recall"][1:]) < 1.0
    assert shared["bits_per_byte"] != own["bits_per_byte"]
    # every layer its own indexer at top-k covering every key is the dense model
    from dsaindex.pipelines.reference.eval import bits_per_byte

    dense = bits_per_byte(net, ids, labels, index_topk=96)
    loss, _ = plan_forward_loss(net, ids, labels, [0, 1, 2, 3], 96)
    assert abs(loss / 0.6931471805599453 - dense) < 2e-3
    with pytest.raises(ValueError, match="not an earlier kept layer"):
        plan_forward_loss(net, ids, labels, [0, 2, 2, 2], TOPK)
    # the MLI lag: kept layer 2 attends layer 0's selection, layer 3 attends layer 2's own
    lagged = plan_quality(net, ids, labels, [0, 0, 0, 2], TOPK)
    plain = plan_quality(net, ids, labels, [0, 0, 2, 2], TOPK)
    assert lagged["retained_recall"][:2] == plain["retained_recall"][:2] == [1.0, shared["retained_recall"][1]]
    assert lagged["retained_recall"][2] < 1.0 == plain["retained_recall"][2]
    assert lagged["bits_per_byte"] != plain["bits_per_byte"]


def test_overlay_loads_onto_its_checkpoint_only(reference, tmp_path):
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.capture.indexer_distill import (
        apply_overlay,
        kept_indexer_parameters,
        write_overlay,
    )
    from dsaindex.pipelines.capture.models import load_model

    loaded, _, _, _ = reference
    net = loaded.model
    params = kept_indexer_parameters(net, [0])
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(0.5)  # a "distilled" indexer
    fingerprint = loaded.fingerprint.model_dump()
    write_overlay(net, [0], tmp_path / "ov", {"plan": {}, "base_checkpoint": fingerprint}, {})
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    fresh = load_model("reference-v1", dtype="float32").model
    manifest = apply_overlay(fresh, tmp_path / "ov", fingerprint)
    assert manifest["kept_layers"] == [0]
    got = dict(fresh.named_parameters())
    assert all(torch.equal(got[n], saved[n] + 0.5) for n in saved)
    with pytest.raises(DsaIndexError, match="another checkpoint"):
        apply_overlay(fresh, tmp_path / "ov", dict(fingerprint, weights_digest="0" * 16))
    weights = tmp_path / "ov" / "indexer_overlay.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(DsaIndexError, match="does not match the digest"):
        apply_overlay(fresh, tmp_path / "ov", fingerprint)
    with pytest.raises(DsaIndexError, match="not empty"):
        write_overlay(net, [0], tmp_path / "ov", {"plan": {}, "base_checkpoint": fingerprint}, {})


def test_cli_distills_for_a_trained_plan(tmp_path):
    """Capture, a reuse bundle, then `train indexer-distill`: the overlay names the plan and the base
    checkpoint, and the report has the three qualities."""
    store, bundle, overlay = tmp_path / "store", tmp_path / "bundle", tmp_path / "overlay"
    proc = run_cli("capture", str(store), "-m", "reference-v1", "-n", "3", "--seq-len", "256", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "reuse", str(store), "--out", str(bundle), "--queries", "16", "--topk", str(TOPK),
                   "--device", "cpu", "--no-register", "--json")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "indexer-distill", "--plan", str(bundle), "-m", "reference-v1", "--retention", "1/2",
                   "--out", str(overlay), "--steps", "3", "--seq-len", "64", "--eval-windows", "2", "--topk", str(TOPK), "--device", "cpu",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {"unmodified", "plan", "distilled"} <= set(result) and len(result["kept"]) == 2
    manifest = json.loads((overlay / "overlay.json").read_text())
    assert manifest["lineage"]["plan"]["retention"] == "1/2" and manifest["lineage"]["base_checkpoint"]["name"]
    proc = run_cli("train", "indexer-distill", "--plan", str(store), "--out", str(tmp_path / "o2"), "--device", "cpu")
    assert proc.returncode != 0 and "error" in proc.stderr.lower()


def test_a_checkpoint_with_its_own_tokenizer_distills_on_its_corpus(tmp_path):
    """The v2 reference (BPE tokens): without --corpus the command refuses rather than train on byte tokens;
    with the corpus's tokens it trains, and bits per byte count the corpus's bytes per token."""
    from dsaindex.pipelines.capture.models import REFERENCE_DIR
    from dsaindex.pipelines.capture.tokens import corpus_token_streams, heldout_windows

    v2 = str(REFERENCE_DIR)
    store, bundle = tmp_path / "store", tmp_path / "bundle"
    proc = run_cli("capture", str(store), "-m", v2, "-n", "3", "--seq-len", "256", "--device", "cpu", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "reuse", str(store), "--out", str(bundle), "--queries", "16", "--topk", str(TOPK),
                   "--device", "cpu", "--no-register", "--json")
    assert proc.returncode == 0, proc.stderr
    args = ("train", "indexer-distill", "--plan", str(bundle), "-m", v2, "--retention", "1/2", "--steps", "2",
            "--seq-len", "64", "--eval-windows", "2", "--topk", str(TOPK), "--device", "cpu")
    proc = run_cli(*args, "--out", str(tmp_path / "o1"))
    assert proc.returncode != 0 and "has its own tokenizer" in proc.stderr and "--corpus" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o1").exists()
    corpus = v2_corpus(tmp_path / "corpus")
    proc = run_cli(*args, "--out", str(tmp_path / "o2"), "--corpus", str(corpus), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # the held-out windows in the corpus's tokens, begun by its own BOS; bits per token over bytes per token
    from dsaindex.pipelines.capture.indexer_distill import plan_quality
    from dsaindex.pipelines.capture.models import load_model

    streams, vocab = corpus_token_streams(corpus)
    assert vocab.bytes_per_token > 2  # BPE: a token holds several bytes
    ids, labels = heldout_windows(torch.from_numpy(streams.heldout), 64, 2, vocab.bos)
    net = load_model(v2, device="cpu", dtype="float32").model
    per_token = plan_quality(net, ids, labels, [0, 1, 2, 3], TOPK)["bits_per_byte"]
    assert result["unmodified"]["bits_per_byte"] == pytest.approx(per_token / vocab.bytes_per_token, rel=1e-3)
    manifest = json.loads((tmp_path / "o2" / "overlay.json").read_text())
    assert "byte-level BPE" in manifest["lineage"]["training"]["corpus"]["tokenizer"]
