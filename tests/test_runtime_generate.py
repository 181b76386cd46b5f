"""The runtime chooses the reference checkpoint's decode-time top-k inside transformers generation."""

import json

import pytest
import torch

from dsaindex.pipelines.capture.models import REFERENCE_V1_DIR
from helpers import reference_bytes, run_cli, v2_corpus

pytestmark = pytest.mark.skipif(not (REFERENCE_V1_DIR / "config.json").is_file(), reason="no reference checkpoint")

TOPK = 32


def _text(skip: int, n: int) -> torch.Tensor:
    return reference_bytes(skip, n)


@pytest.fixture(scope="module")
def model_and_layers():
    """The reference model at top-32 and PQ32 codebooks trained on its keys of another text."""
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.pq import PQCodec
    from helpers import reference_pq_codebooks

    net = load_model("reference-v1", dtype="float32").model
    set_index_topk(net, TOPK)
    return net, {i: PQCodec(codebooks) for i, codebooks in reference_pq_codebooks().items()}


def test_all_keys_as_candidates_reproduces_exhaustive_generation(model_and_layers):
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, layers = model_and_layers
    result = greedy_agreement(net, layers, _text(0, 300), 16, candidates=1024, use_triton=False)
    assert result["teacher_forced"]["token_agreement"] >= 15 / 16
    assert set(result["selection_recall"]) == {"0", "1", "2", "3"}
    assert min(result["selection_recall"].values()) >= 0.97, result["selection_recall"]


@pytest.fixture(scope="module")
def coarse_to_fine(model_and_layers):
    """Greedy agreement of PQ selection with C = 2 x top-k on a 400-token prompt (two tests read it)."""
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, layers = model_and_layers
    return greedy_agreement(net, layers, _text(5000, 400), 16, candidates=2 * TOPK, use_triton=False)


def test_coarse_to_fine_keeps_most_of_the_models_own_selection(model_and_layers, coarse_to_fine):
    from dsaindex.runtime.transformers_adapter import RuntimeSelection

    net, layers = model_and_layers
    result = coarse_to_fine
    assert 0.6 <= min(result["selection_recall"].values()) <= 1.0
    assert sum(result["selection_recall"].values()) / 4 >= 0.8, result["selection_recall"]
    assert result["teacher_forced"]["token_agreement"] >= 0.75
    # the hooks are gone after the context: the model selects on its own again
    with RuntimeSelection(net, layers, 1, 64, use_triton=False):
        pass
    assert all(not m.self_attn.indexer._forward_hooks for m in net.model.layers)


def test_artifacts_missing_a_layer_are_refused(model_and_layers):
    from dsaindex.runtime.loader import ArtifactMismatchError
    from dsaindex.runtime.transformers_adapter import RuntimeSelection

    net, layers = model_and_layers
    with pytest.raises(ArtifactMismatchError, match=r"no layer \[3\]"):
        RuntimeSelection(net, {k: v for k, v in layers.items() if k != 3}, 1, 64)


@pytest.fixture(scope="module")
def bundles(model_and_layers, tmp_path_factory):
    """The fixture's codebooks as a bundle of the reference model, and the same codebooks recorded as
    trained for other weights."""
    from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
    from dsaindex.pipelines.capture.models import load_model

    _, layers = model_and_layers
    root = tmp_path_factory.mktemp("generate")
    own = load_model("reference-v1", dtype="float32").fingerprint  # the checkpoint as shipped (its own top-k)
    lineage = Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                      train_sequences=[0], eval_sequences=[1])
    arrays = {i: {"codebooks": codec.codebooks.numpy()} for i, codec in layers.items()}
    paths = {}
    for name, model in (("own", own), ("other", own.model_copy(update={"weights_digest": "0" * 16}))):
        manifest = new_bundle_manifest(model, "hadamard", own.geometry.key_format,
                                       {i: LayerArtifact(kind="pq", params={"subspaces": 32}) for i in layers}, lineage)
        write_bundle(root / name, manifest, arrays)
        paths[name] = root / name
    return paths


def test_generate_cli_shows_progress_per_token(bundles, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path: the kernels have tests of their own
    proc = run_cli("runtime", "generate", "-m", "reference-v1", "-a", str(bundles["own"]), "--topk", str(TOPK),
                   "--candidates", "64",
                   "--prompt-tokens", "200", "--new-tokens", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "10/10 tokens" in proc.stderr  # 2 tokens x (exhaustive, free, forced, and both on the real text)
    result = json.loads(proc.stdout)
    assert result["prompt_tokens"] == 200 and result["topk"] == TOPK and set(result["selection_recall"]) == {"0", "1", "2", "3"}


def test_generate_refuses_artifacts_of_other_weights(bundles):
    proc = run_cli("runtime", "generate", "-m", "reference-v1", "-a", str(bundles["other"]), "--new-tokens", "1",
                   "--device", "cpu")
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: The artifacts were trained for reference") and "weights_digest" in first


def test_length_policy_in_generation_scores_exactly(model_and_layers, coarse_to_fine):
    """With every request under the length policy, the runtime's selection is the exact FP8 top-k: the
    model's own top-k up to FP8 key rounding."""
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, layers = model_and_layers
    pq = coarse_to_fine  # the same prompt and settings through PQ
    exact = greedy_agreement(net, layers, _text(5000, 400), 16, candidates=2 * TOPK, use_triton=False,
                             exact_below=10_000)
    assert min(exact["selection_recall"].values()) >= 0.97, exact["selection_recall"]
    # both rerank with the same FP8 keys, so PQ can only lose what its coarse stages miss; the free runs'
    # tokens may differ, which moves either sum by a step's worth
    assert sum(exact["selection_recall"].values()) >= sum(pq["selection_recall"].values()) - 0.02
    assert exact["teacher_forced"]["token_agreement"] >= 0.9


def test_generate_takes_prompts_from_a_corpus_in_its_tokens(tmp_path, bundles):
    from types import SimpleNamespace

    from dsaindex.pipelines.commands.runtime import _heldout_text

    corpus = v2_corpus(tmp_path / "corpus")
    tokens, bos, decode = _heldout_text(corpus, SimpleNamespace(vocab_size=8192), 100)
    assert bos == 0 and decode(tokens[:40].tolist()).startswith("It was a bright cold day in April 0.")
    # the byte-level reference checkpoint cannot read it: refused before anything runs
    proc = run_cli("runtime", "generate", "-m", "reference-v1", "-a", str(bundles["own"]), "--corpus", str(corpus),
                   "--new-tokens", "1", "--device", "cpu")
    assert proc.returncode == 2
    assert "vocabulary of 8,192 entries; the model has 260" in proc.stderr.splitlines()[0]
    # the default reference (v2, its own BPE) without a corpus: refused rather than fed byte tokens
    proc = run_cli("runtime", "generate", "-a", str(bundles["own"]), "--new-tokens", "1", "--device", "cpu")
    assert proc.returncode == 2
    assert "has its own tokenizer" in proc.stderr.splitlines()[0] and "--corpus" in proc.stderr
