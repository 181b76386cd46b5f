"""The reference checkpoint's gates and card: the gates' forward, needle prompts, the top-k structure
measures, and the committed v2 card."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dsaindex.indexer import set_index_topk
from dsaindex.pipelines.capture.models import REFERENCE_V1_DIR
from dsaindex.pipelines.capture.presets import BOS_ID, TINY_REFERENCE_CONFIG, reference_config
from dsaindex.pipelines.capture.tokens import corpus_token_streams, heldout_windows
from dsaindex.pipelines.reference.forward import build_model
from helpers import tiny_reference_corpus, trained_looking_model


def test_gates_forward_needles_and_shuffled_prefix(tmp_path):
    """The gates' forward is the transformers forward (dense and top-k sparse); needle prompts hold every
    statement and end with the asked value; the shuffled-prefix measure compares the same tail."""
    from tokenizers import Tokenizer

    from dsaindex.pipelines.reference import gates as rg

    corpus = tiny_reference_corpus(tmp_path / "corpus")
    streams, vocab = corpus_token_streams(corpus)
    config = reference_config(TINY_REFERENCE_CONFIG, vocab_size=vocab.size, bos_token_id=vocab.bos,
                              eos_token_id=vocab.eos, pad_token_id=vocab.pad, index_topk=8)
    model = build_model(config, seed=3).eval()
    held = torch.from_numpy(streams.heldout)
    ids = held[:150][None].long()
    for topk in (4096, 8):
        set_index_topk(model, topk)
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
        got = rg.model_logits(model, ids, None if topk == 4096 else topk)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tok = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    prompts = rg.needle_prompts(corpus / "tokenizer.json", held, 400, 3, keys=3, bos=vocab.bos)
    for prompt, first, n in prompts:
        assert prompt.shape == (400,) and int(prompt[0]) == vocab.bos and first + n == 400
        text = tok.decode(prompt.tolist())
        asked = text.rsplit("passkey for ", 1)[1].split(" is")[0]
        value = tok.decode(prompt[first:].tolist()).strip()
        assert text.count("The passkey for") == 3 and f"The passkey for {asked} is {value}." in text
    assert 0.0 <= rg.needle_accuracy(model, prompts) <= 1.0
    gain = rg.shuffled_prefix_gain(model, held, 256, 2, bos=vocab.bos)
    assert gain["tail"] == 64 and math.isfinite(gain["gain"]) and gain["true"] > 0
    assert gain["gain"] == pytest.approx(gain["shuffled"] - gain["true"])


def test_committed_v2_card_reports_its_gates_and_tokenizer():
    """The v2 checkpoint (the default `reference`) ships its tokenizer and sources, and its card renders the
    metrics: every stage, the tokenizer, the sources table and the gates, dense and sparse, and where the
    top-k lies beside the part IVF routes and the random-placement floor."""
    from dsaindex.pipelines.reference.card import model_card

    v2 = REFERENCE_V1_DIR.parent / "reference_model_v2"
    if not (v2 / "metrics.json").is_file():
        pytest.skip("the v2 checkpoint is not committed")
    metrics = json.loads((v2 / "metrics.json").read_text())
    card = model_card(metrics)
    stages = metrics["training"]["earlier_stages"] + metrics["training"]["stages"]
    assert [s["name"] for s in stages] == ["dense", "dense", "warmup", "sparse"] * 2  # two passes
    assert card.count("\n| dense |") == 4 and card.count("| sparse | top-512 |") == 2
    assert "passkey tasks in 50% of windows" in card and card.startswith("# dsaindex reference DSA checkpoint\n\n**Status:**")
    assert f"byte-level BPE of {metrics['model']['vocabulary']['entries']} entries" in card
    assert "| sotu |" in card and "| austen |" in card  # the corpus's sources table
    g = metrics["gates"]["results"]["32768"]
    assert f"needle accuracy {g['needle_accuracy_sparse']:.2f}" in card
    assert f"{g['bits_per_byte_sparse'] / g['bits_per_byte_dense']:.4f} x dense" in card
    t = metrics["gates"]["topk_structure"]["32768"]
    assert t["random_keys_per_block"] < t["routed_keys_per_block"] < t["keys_per_block"]
    assert f"(what IVF routes) {t['routed_keys_per_block']:.2f}" in card and "Top-k structure: `dsaindex " in card
    config = json.loads((v2 / "config.json").read_text())
    assert config["vocab_size"] == 8192 and (v2 / "tokenizer.json").is_file()
    assert sum(p.stat().st_size for p in v2.glob("model*.safetensors")) < 40e6


def test_topk_structure_coverage_is_the_evaluations_and_blocks_count_keys():
    from dsaindex.pipelines.reference import gates as rg
    from dsaindex.pipelines.reference.eval import attention_coverage

    model = trained_looking_model()
    stream = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(4)).long()
    got = rg.topk_structure(model, stream, 128, 2, topk=8, queries=16, bos=BOS_ID, block=16, far=32)
    ids, _ = heldout_windows(stream, 128, 2)
    want = attention_coverage(model, ids, 8, query_count=16)
    for name in ("coverage", "oracle", "window"):
        for a, b in zip((layer[name] for layer in got["layers"]), want["per_layer"][name], strict=True):
            assert a == pytest.approx(b, abs=1e-4), name
    assert got["queries"] == 32 and got["oracle"] >= got["coverage"]
    for layer in got["layers"]:
        assert 1.0 <= layer["keys_per_block"] <= 8.0 and 0.0 <= layer["far_share"] <= 1.0
    one = rg.topk_structure(model, stream, 128, 1, topk=8, queries=16, bos=BOS_ID, block=1, far=0)
    assert one["keys_per_block"] == pytest.approx(1.0)  # blocks of one key: one key per touched block
    # the routed part: with no open window it is the whole top-k, with one as long as the window nothing
    whole = rg.topk_structure(model, stream, 128, 1, topk=8, queries=16, bos=BOS_ID, block=16, open_window=0)
    assert whole["routed_keys_per_block"] == pytest.approx(whole["keys_per_block"])
    none = rg.topk_structure(model, stream, 128, 1, topk=8, queries=16, bos=BOS_ID, block=16, open_window=128)
    assert none["routed_keys_per_block"] == 0.0


def test_random_keys_per_block_is_the_scattered_floor():
    from dsaindex.pipelines.reference.gates import random_keys_per_block

    assert random_keys_per_block(4096, 1) == pytest.approx(1.0)
    assert random_keys_per_block(128, 64, block=128) == pytest.approx(64.0)  # one block holds them all
    assert 2.2 < random_keys_per_block(32768, 512) < 2.4 < random_keys_per_block(16384, 512)
    rng = np.random.default_rng(0)  # against sampling: k random keys of a prefix, touched blocks counted
    picks = [np.unique(rng.choice(1000, 50, replace=False) // 16).size for _ in range(4000)]
    assert random_keys_per_block(1000, 50, block=16) == pytest.approx(50 / np.mean(picks), rel=0.01)
