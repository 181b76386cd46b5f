"""``dsaindex runtime quality``: held-out NLL and KL of the model with the runtime's selection against its
own exact selection, teacher forced through prefill + decode steps (pipelines/reference/quality.py)."""

import json
import math

import pytest
import torch

from helpers import model_index_keys, run_cli, trained_looking_model

TOPK = 8  # the tiny reference geometry's top-k (2 layers, 1,024 positions), with 16 index heads x 32 dims


def _tiny_model():
    """A tiny reference-geometry model with a peaked main attention and spread indexer weights, and 16
    index heads: with the 4 of the tiny geometry, one key in 16 scores exactly 0 (every head's ReLU
    zero) and such ties sit inside the top-k wherever head weights are negative, so that the model's own
    choice among them depends on the order of its float operations (one forward vs decode steps)."""
    return trained_looking_model(topk=TOPK, index_n_heads=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny reference-geometry checkpoint saved to a folder, loaded back as the command loads it, PQ codecs
    trained on its keys of random text (2 x 600 tokens), and two bundles of them: one recorded for this
    checkpoint, one for other weights."""
    from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.pq import PQCodec, PQSpec
    from dsaindex.train.codebooks import train_codebooks

    root = tmp_path_factory.mktemp("quality")
    _tiny_model().save_pretrained(root / "ckpt")
    loaded = load_model(str(root / "ckpt"), dtype="float32")
    net = loaded.model
    generator = torch.Generator().manual_seed(0)
    per_text = [model_index_keys(net, torch.randint(0, 256, (600,), generator=generator)) for _ in range(2)]
    keys = {i: torch.cat([k[i] for k in per_text]) for i in per_text[0]}
    codecs = {i: PQCodec(train_codebooks(k, PQSpec(dim=32, subspaces=8), "torch", 6)) for i, k in keys.items()}
    lineage = Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                      train_sequences=[0], eval_sequences=[1])
    own = loaded.fingerprint
    bundles = {}
    for name, model in (("own", own), ("other", own.model_copy(update={"weights_digest": "0" * 16}))):
        manifest = new_bundle_manifest(model, "hadamard", own.geometry.key_format,
                                       {i: LayerArtifact(kind="pq", params={"subspaces": 8}) for i in codecs}, lineage)
        write_bundle(root / name, manifest, {i: {"codebooks": c.codebooks.numpy()} for i, c in codecs.items()})
        bundles[name] = root / name
    return net, codecs, root / "ckpt", bundles


def _document(n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([256]), torch.randint(0, 256, (n - 1,), generator=generator)])


def _runtime(net, codecs, candidates: int, prefilter: int = 4):
    from dsaindex.runtime.serving import ServedIndex
    from dsaindex.runtime.settings import DecodeSettings, ServeSettings

    settings = ServeSettings(decode=DecodeSettings(candidates=candidates, prefilter=prefilter), measure_recall=True,
                             max_keys=512, use_triton=False)
    return ServedIndex(net, codecs, {}, settings)


def _scores(net, codecs, tokens, candidates, min_prefix=TOPK + 1, prefilter=4):
    from dsaindex.pipelines.reference.quality import band_summary, teacher_forced_scores

    runtime = _runtime(net, codecs, candidates, prefilter)
    with runtime:
        scores = teacher_forced_scores(net, runtime, tokens, min_prefix, prefill_chunk=16)
    return scores, band_summary(scores), runtime.log


def test_exact_nll_is_the_cross_entropy_of_one_forward(tiny):
    """The exact run (prefill in chunks, then decode steps) scores the same tokens as one teacher-forced
    forward with the model's own selection, position for position."""
    net, codecs, _, _ = tiny
    tokens = _document(48)
    scores, summary, _ = _scores(net, codecs, tokens, candidates=64, min_prefix=20)
    with torch.no_grad():
        logits = net(input_ids=tokens[None], use_cache=False).logits[0].float()
    want = torch.nn.functional.cross_entropy(logits[19:-1], tokens[20:], reduction="none")
    assert scores.prefix == list(range(20, 48))
    torch.testing.assert_close(torch.tensor(scores.nll_exact), want, rtol=1e-4, atol=1e-4)
    assert summary["positions"] == 28
    assert summary["nll_exact"] == pytest.approx(float(want.mean()), rel=1e-4)


def test_every_key_a_candidate_keeps_the_exact_selection_and_a_poor_budget_does_not(tiny):
    """With C past every prefix the runtime keeps the model's own top-k up to its FP8 keys (the engines'
    132-byte format, rescored with bf16 queries: near-ties flip, so equality holds only to within those
    flips): its NLL stays within a fraction of a percent of the exact one and its KL is near 0. With
    C = top-k and stage 1 = C the PQ code alone picks the keys of the completed pages (the document spans
    three 64-key pages: only the newest page is rescored exactly), and the model's output moves."""
    net, codecs, _, _ = tiny
    tokens = _document(200)
    full, full_summary, full_log = _scores(net, codecs, tokens, candidates=256, min_prefix=150)
    poor, poor_summary, poor_log = _scores(net, codecs, tokens, candidates=TOPK, prefilter=1, min_prefix=150)
    assert full_log.queries["decode"] == {0: 50, 1: 50}  # the runtime chose every scored step's keys
    full_recall, poor_recall = full_log.recall()["decode"], poor_log.recall()["decode"]
    assert min(full_recall.values()) >= 0.9 and max(poor_recall.values()) < 0.8, (full_recall, poor_recall)
    assert abs(full_summary["nll_delta_pct"]) < 0.5
    assert full_summary["kl"] < 5e-3
    # the exact run does not depend on the runtime's budget
    assert full.nll_exact == pytest.approx(poor.nll_exact, abs=1e-5)
    assert poor_summary["kl"] > 3 * full_summary["kl"] > 0

    def moved(scores):
        return sum(abs(a - b) for a, b in zip(scores.nll_runtime, scores.nll_exact, strict=True)) / 50

    assert moved(poor) > 2 * moved(full) > 0
    # KL(p_exact || p_runtime) >= 0 at every position
    assert min(poor.kl) >= 0.0 and max(poor.kl) > 1e-2


def test_bands_partition_the_scored_positions():
    from dsaindex.pipelines.reference.quality import PositionScores, prefix_bands, summarize

    assert prefix_bands(9, 96) == [(9, 16), (16, 32), (32, 64), (64, 96)]
    assert prefix_bands(16, 40) == [(16, 32), (32, 40)]
    assert prefix_bands(513, 32768)[0] == (513, 1024) and prefix_bands(513, 32768)[-1] == (16384, 32768)
    scores = PositionScores(prefix=list(range(9, 96)), nll_exact=[2.0] * 87, nll_runtime=[2.0 + i / 87 for i in range(87)],
                            kl=[0.01 * (i % 3) for i in range(87)])
    result = summarize({96: scores}, 9)
    bands = result["lengths"][0]["bands"]
    assert sum(b["positions"] for b in bands) == result["overall"]["positions"] == 87
    assert result["overall"]["nll_delta_pct"] == pytest.approx(100 * (sum(scores.nll_runtime) / 87 - 2.0) / 2.0)
    # later prefixes carry the larger runtime NLL here: the bands show the trend the mean hides
    deltas = [b["nll_delta_pct"] for b in bands]
    assert deltas == sorted(deltas)


def test_pick_documents_takes_whole_held_out_documents_cut_to_length():
    import numpy as np

    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.reference.quality import pick_documents, split_documents

    eos, bos = 257, 256
    stream = np.array([1] * 5 + [eos] + [2] * 30 + [eos] + [3] * 12 + [eos] + [4] * 40 + [eos])
    assert split_documents(stream, eos) == [(0, 5), (6, 36), (37, 49), (50, 90)]
    docs = pick_documents(stream, eos, bos, 21, 5, titles=["a", "b", "c", "d"])
    assert [(d.index, d.title, d.full_tokens) for d in docs] == [(1, "b", 30), (3, "d", 40)]
    assert docs[0].tokens.tolist() == [bos] + [2] * 20
    with pytest.raises(DsaIndexError, match="longest of the 4 held-out documents has 41") as err:
        pick_documents(stream, eos, bos, 64, 1)
    assert "--lengths of at most 41" in err.value.fix


def test_quality_command_reports_bands_and_writes_json(tiny, tmp_path):
    _, _, ckpt, bundles = tiny
    out = tmp_path / "quality.json"
    proc = run_cli("runtime", "quality", "-m", str(ckpt), "-a", str(bundles["own"]), "--lengths", "24,40",
                   "--documents", "1", "--candidates", "16", "--prefilter", "1", "--device", "cpu",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "held-out NLL, exact vs runtime selection" in proc.stdout and "overall" in proc.stdout
    assert "decode pq: layers 0-1" in proc.stderr
    result = json.loads(out.read_text())
    assert result["topk"] == TOPK and result["min_prefix"] == TOPK + 1
    assert result["candidates"] == {"0": 16, "1": 16}
    assert [e["length"] for e in result["lengths"]] == [24, 40]
    assert [e["all"]["positions"] for e in result["lengths"]] == [24 - 9, 40 - 9]
    assert result["overall"]["positions"] == 15 + 31
    for entry in result["lengths"]:
        assert entry["documents"][0]["tokens"] >= entry["length"] - 1
        assert set(entry["selection_recall"]["decode"]) == {"0", "1"}
        assert 0 < entry["all"]["nll_exact"] < 2 * math.log(260)
        assert entry["all"]["kl"] >= 0


@pytest.mark.parametrize("case", ["other weights", "no checkpoint", "too long", "no room to score"])
def test_bad_input_names_the_fix(tiny, tmp_path, case):
    _, _, ckpt, bundles = tiny
    args = {"other weights": ["-m", str(ckpt), "-a", str(bundles["other"]), "--lengths", "40"],
            "no checkpoint": ["-m", str(tmp_path / "missing"), "-a", str(bundles["own"])],
            "too long": ["-m", str(ckpt), "-a", str(bundles["own"]), "--lengths", "512,2K"],
            "no room to score": ["-m", str(ckpt), "-a", str(bundles["own"]), "--lengths", "40",
                                 "--min-prefix", "40"]}[case]
    proc = run_cli("runtime", "quality", *args, "--candidates", "16", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("error:") and "Traceback" not in proc.stderr
    want = {"other weights": "weights_digest", "no checkpoint": "No local checkpoint",
            "too long": "beyond the checkpoint's longest sequence (max_position_embeddings 1,024)",
            "no room to score": "leaves no position to score"}[case]
    assert want in first and " Fix: " in first, first


def test_serving_options_default_to_the_settings_fields():
    """The runtime is measured at the server's defaults: every option named after a settings field takes
    that field's default (as `serve`, `runtime generate` and `runtime check` do)."""
    import dataclasses

    import typer

    from dsaindex.cli import app
    from dsaindex.runtime.settings import DecodeSettings, PrefillSettings, ServeSettings

    fields = {f.name: f.default for kind in (DecodeSettings, PrefillSettings, ServeSettings)
              for f in dataclasses.fields(kind) if f.default is not dataclasses.MISSING}
    cmd = typer.main.get_command(app).commands["runtime"].commands["quality"]
    checked = [p.name for p in cmd.params if p.name in fields]
    for param in cmd.params:
        if param.name in fields:
            assert param.default == fields[param.name] or str(param.default) == str(fields[param.name]), param.name
    assert {"candidates", "prefilter", "recall_target", "exact_below", "ivf_budget", "ivf_recall_target",
            "basis", "allow_other_weights"} <= set(checked)
