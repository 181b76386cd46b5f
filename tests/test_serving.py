"""The runtime serving whole requests in the reference checkpoint: IVF prefill, PQ decode, exact fallback,
artifacts resolved and validated by ``load``; and ``dsaindex serve``: transformers' own server answering a
real HTTP request on loopback with the runtime installed."""

import functools
import inspect
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dsaindex.pipelines.capture.models import REFERENCE_V1_DIR
from dsaindex.runtime.operating_points import expected_step_us
from dsaindex.runtime.settings import ServeSettings
from helpers import reference_bytes, serve

pytestmark = pytest.mark.skipif(not (REFERENCE_V1_DIR / "config.json").is_file(), reason="no reference checkpoint")

TOPK = 32


def _text(skip: int, n: int) -> torch.Tensor:
    return reference_bytes(skip, n)


def _bundles(root, net, fingerprint, pq=True, ivf=True, layers=(0, 1, 2, 3), pq_metrics=None, ivf_metrics=None):
    """A PQ32 bundle trained on the model's keys of another text, and an IVF bundle whose encoder adds
    nothing to the cluster means (routing by plain means), both recorded as trained for ``fingerprint``.
    ``pq_metrics``: the held-out metrics the PQ bundle records (as ``train pq`` writes them)."""
    from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
    from dsaindex.artifacts.kinds import ENCODER_ARRAYS
    from dsaindex.geometry import geometry_from_config
    from helpers import reference_pq_codebooks

    geometry = geometry_from_config(net.config)
    lineage = Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                      train_sequences=[0], eval_sequences=[1])
    paths = []
    if pq:  # the reference checkpoint's codebooks (``net`` is the reference model in every test here)
        codebooks = reference_pq_codebooks()
        arrays = {i: {"codebooks": codebooks[i].numpy()} for i in layers}
        manifest = new_bundle_manifest(fingerprint, "hadamard", geometry.key_format,
                                       {str(i): LayerArtifact(kind="pq", params={"subspaces": 32, "score_aware": False})
                                        for i in layers}, lineage, metrics=pq_metrics)
        write_bundle(root / "pq", manifest, arrays)
        paths.append(root / "pq")
    if ivf:
        rng = np.random.default_rng(0)
        d, f, h = geometry.head_dim, 8, 16
        shapes = {"phi_weight": (f, d), "phi_bias": (f,), "hidden_weight": (h, d + 1 + 2 * f), "hidden_bias": (h,),
                  "out_weight": (d, h), "out_bias": (d,)}
        assert set(shapes) == set(ENCODER_ARRAYS)
        arrays = {i: {k: (np.zeros(s) if k.startswith("out") else rng.standard_normal(s)).astype(np.float32)
                      for k, s in shapes.items()} for i in layers}
        params = {"window": 64, "cluster_size": 16, "refit_every": 0, "sinks": 4, "features": f, "hidden": h}
        manifest = new_bundle_manifest(fingerprint, "hadamard", geometry.key_format,
                                       {str(i): LayerArtifact(kind="ivf", params=params) for i in layers}, lineage,
                                       metrics=ivf_metrics)
        write_bundle(root / "ivf", manifest, arrays)
        paths.append(root / "ivf")
    return paths


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The reference model at top-32 and its two bundles (PQ for decode, IVF for prefill)."""
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model

    loaded = load_model("reference-v1", dtype="float32")
    net = loaded.model
    identity = loaded.fingerprint  # the checkpoint's; the top-k below is a serving setting
    set_index_topk(net, TOPK)
    paths = _bundles(tmp_path_factory.mktemp("bundles"), net, identity)
    return net, paths, identity


def _generate(net, prompt, n):
    out = net.generate(prompt.unsqueeze(0), max_new_tokens=n, do_sample=False, num_beams=1)
    return out[0, prompt.numel():]


def test_whole_requests_select_through_ivf_and_pq(served):
    """Prefill through IVF and decode through PQ, per layer; with budgets that cover every key the
    selection is the model's own up to FP8 rounding (both keep the engines' 132-byte FP8 keys and rescore
    from them, where the model scores its float keys: near-ties flip) and generation matches exhaustive
    selection."""
    from dsaindex.runtime.serving import LayerPaths

    net, paths, identity = served
    prompt = _text(0, 300)
    want = _generate(net, prompt, 12)
    # budgets past the longest request (313 keys): every key a candidate (a larger IVF budget pads each
    # query's candidate list with unused rows, and the CPU refine scores them all)
    index = serve(paths, net, served=identity, candidates=1024, prefilter=2, ivf_budget=512, use_triton=False,
                 measure_recall=True)
    assert index.paths() == {i: LayerPaths("ivf", "pq") for i in range(4)}
    assert index.describe() == ("prefill ivf: layers 0-3; decode pq: layers 0-3; prefill IVF budget: 512 candidates "
                                "a query; decode points: layers 0, 1, 2, 3: "
                                "C = 1024, stage 1 2 x C by codes, held-out recall not recorded, a query reads 0.25x "
                                "the exact scan's bytes at 128K keys, 0.24x at 1M, expected step "
                                f"{expected_step_us('codes', 2, 1024, (0, 1)):.1f} us a query at 1M keys (H100)")  # no band: C fixed
    with index:
        got = _generate(net, prompt, 12)
        assert all(ix == [None] for ix in index.ivf.values())  # decoding dropped the prefill indexes
        assert all(group.pages[0] for group in index.groups.values())  # the decode state stays
        second = _generate(net, _text(900, 200), 4)  # a new request: its state starts empty
    assert torch.equal(got, want)
    assert len(second) == 4
    queries = index.log.queries
    assert queries["prefill"] == {i: 301 + 201 for i in range(4)}  # every prompt position, both requests
    assert queries["decode"] == {i: 11 + 3 for i in range(4)}
    recall = index.log.recall()
    assert min(recall["prefill"].values()) >= 0.98 and min(recall["decode"].values()) >= 0.97, recall
    assert all(not m.self_attn.indexer._forward_hooks for m in net.model.layers)


def test_the_ivf_budget_is_chosen_from_the_bundles_recorded_recall(served, tmp_path):
    """Without a budget, serving takes the smallest one whose recorded held-out recall (learned routing,
    as ``train ivf`` writes it) reaches the prefill target; a bundle below it at every budget is refused
    naming the best; one that records none keeps 8 x top-k; a budget given is taken as given."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import ivf_budget_for_recall

    net, _, identity = served
    recorded = {"mean/ivf-learned/recall@64": 0.90, "mean/ivf-learned/recall@128": 0.96,
                "mean/ivf-learned/recall@256": 0.99, "mean/ivf/recall@64": 0.99}  # plain IVF's: not read
    assert ivf_budget_for_recall(recorded, 0.95) == 128 and ivf_budget_for_recall(recorded, 0.98) == 256
    assert ivf_budget_for_recall({}, 0.95) is None
    paths = _bundles(tmp_path / "a", net, identity, pq=False, ivf_metrics=recorded)
    assert serve(paths, net, served=identity, use_triton=False).ivf_budget == 128
    assert "prefill IVF budget: 128 candidates a query" in serve(paths, net, served=identity).describe()
    assert serve(paths, net, served=identity, ivf_recall_target=0.98).ivf_budget == 256
    assert serve(paths, net, served=identity, ivf_budget=64).ivf_budget == 64
    with pytest.raises(DsaIndexError, match=r"at most 99\.00% \(IVF budget 256\).*--ivf-budget"):
        serve(paths, net, served=identity, ivf_recall_target=0.995)
    bare = _bundles(tmp_path / "b", net, identity, pq=False)
    assert serve(bare, net, served=identity).ivf_budget == 8 * TOPK


def test_tight_budgets_select_and_layers_without_artifacts_stay_exact(served):
    from dsaindex.runtime.serving import LayerPaths

    net, paths, identity = served
    index = serve(paths[:1], net, served=identity, candidates=2 * TOPK, prefilter=2, use_triton=False,
                 measure_recall=True)
    assert index.paths()[0] == LayerPaths("exact", "pq")
    assert index.describe() == ("prefill exact: layers 0-3; decode pq: layers 0-3; decode points: layers 0, 1, 2, 3: "
                                f"C = {2 * TOPK}, stage 1 2 x C by codes, held-out recall not recorded, a query reads "
                                "0.24x the exact scan's bytes at 128K keys, 0.24x at 1M, expected step "
                                f"{expected_step_us('codes', 2, 2 * TOPK, (0, 1)):.1f} us a query at 1M keys (H100)")
    with index:
        _generate(net, _text(3000, 500), 10)
    assert index.log.queries["prefill"] == {}  # the model's own prefill selection
    recall = index.log.recall()["decode"]
    assert 0.6 <= min(recall.values()) and sum(recall.values()) / 4 >= 0.8, recall
    ivf_only = serve(paths[1:], net, served=identity, ivf_budget=8 * TOPK, use_triton=False, measure_recall=True)
    with ivf_only:
        _generate(net, _text(3000, 500), 3)
    assert ivf_only.log.queries["decode"] == {}
    assert min(ivf_only.log.recall()["prefill"].values()) >= 0.7, ivf_only.log.recall()


def test_artifacts_of_another_model_or_twice_the_same_kind_are_refused(served, tmp_path):
    from dsaindex.artifacts.fingerprint import fingerprint_model
    from dsaindex.errors import ArtifactMismatchError
    from dsaindex.pipelines.capture.models import load_model

    net, paths, identity = served
    with pytest.raises(ArtifactMismatchError, match="two decode artifacts"):
        serve([paths[0], paths[0]], net, served=identity, candidates=2 * TOPK)
    other = load_model("reference-v1", dtype="float32").model
    with torch.no_grad():
        other.model.layers[1].self_attn.indexer.wk.weight.mul_(1.01)  # another model, same geometry
    other_paths = _bundles(tmp_path, net, fingerprint_model(other, "reference-v1"), ivf=False)
    with pytest.raises(ArtifactMismatchError):
        serve(other_paths, net, served=identity, candidates=2 * TOPK)
    serve(other_paths, net, allow_other_weights=True, candidates=2 * TOPK)  # a deliberate transfer


def _recall_metrics(per_layer):
    """Bundle metrics as ``train pq`` records them: per layer {C: overall recall} of the top-32, and the
    64K-128K band's {C: recall} with its query count."""
    out = {}
    for layer, (overall, band, queries) in per_layer.items():
        out.update({f"layer{layer}/k{TOPK}/rerank@{c}": r for c, r in overall.items()})
        out[f"layer{layer}/k{TOPK}@0-16K/queries"] = 40.0
        out.update({f"layer{layer}/k{TOPK}@0-16K/rerank@{c}": 1.0 for c in overall})
        out[f"layer{layer}/k{TOPK}@64K-128K/queries"] = float(queries)
        out.update({f"layer{layer}/k{TOPK}@64K-128K/rerank@{c}": r for c, r in band.items()})
        out[f"layer{layer}/k512/rerank@64"] = 0.1  # another top-k's figures are not read
    return out


def test_candidates_are_chosen_per_layer_from_the_bundles_recall(served, tmp_path):
    """``candidates="auto"``: each decode layer gets the smallest C whose recorded held-out recall reaches
    the target, at the longest prefix band too where it has enough queries; the groups run with it."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.serving import candidates_for_recall

    net, _, identity = served
    full = {64: 0.999, 128: 1.0, 256: 1.0}
    per_layer = {
        0: ({64: 0.990, 128: 0.996, 256: 0.999}, {64: 0.98, 128: 0.994, 256: 0.998}, 20),  # the band decides: 256
        1: (full, full, 20),  # 64
        2: ({64: 0.990, 128: 0.997, 256: 1.0}, {64: 0.95, 128: 0.99, 256: 1.0}, 3),  # band too thin to count: 128
        3: ({64: 0.999, 128: 1.0, 256: 1.0}, {64: 0.999, 128: 1.0, 256: 1.0}, 20),  # 64
    }
    metrics = _recall_metrics(per_layer)
    assert candidates_for_recall(metrics, [0, 1, 2, 3], TOPK, 0.995) == {0: 256, 1: 64, 2: 128, 3: 64}
    assert candidates_for_recall(metrics, [0, 1, 2, 3], TOPK, 0.99) == {0: 128, 1: 64, 2: 64, 3: 64}
    with pytest.raises(DsaIndexError, match=r"Layer 0 .* at most 99\.80% .* C = 256.*99\.90%"):
        candidates_for_recall(metrics, [0, 1], TOPK, 0.999)
    with pytest.raises(DsaIndexError, match="records no held-out recall of the top-16 for layer 0"):
        candidates_for_recall(metrics, [0], 16)
    paths = _bundles(tmp_path, net, identity, ivf=False, pq_metrics=metrics)
    index = serve(paths, net, served=identity, candidates="auto", recall_target=0.995, prefilter=2, use_triton=False)
    assert index.candidates == {0: 256, 1: 64, 2: 128, 3: 64}
    assert {layer: group.candidates for layer, group in index.groups.items()} == index.candidates
    assert index.describe().startswith("prefill exact: layers 0-3; decode pq: layers 0-3; decode C: 64 (layers 1, 3), "
                                       "128 (layers 2), 256 (layers 0); decode points: layer 0: C = 256, stage 1 2 x C "
                                       "by codes, held-out recall")
    # the default is `auto`: the same choice with no setting given, and a bundle without recall is refused
    assert serve(paths, net, served=identity, prefilter=2, use_triton=False).candidates == index.candidates
    with index:  # the groups serve with their own C
        _generate(net, _text(3000, 400), 3)
    bare = _bundles(tmp_path / "bare", net, identity, ivf=False)
    with pytest.raises(DsaIndexError, match="records no held-out recall"):
        serve(bare, net, served=identity, candidates="auto")
    with pytest.raises(DsaIndexError, match="records no held-out recall.*pass a number to --candidates"):
        serve(bare, net, served=identity)  # the default refuses too, naming what would serve
    # the served recall per stage-1 factor: layer 0 needs 8 x C, the others do with 2 x C
    staged = dict(metrics)
    for layer in range(4):
        for p in (2, 8):
            good = p == 8 or layer != 0
            staged.update({f"layer{layer}/k{TOPK}/prefilter{p}@{c}": 0.999 if good else 0.9 for c in (64, 128, 256)})
    paths = _bundles(tmp_path / "staged", net, identity, ivf=False, pq_metrics=staged)
    index = serve(paths, net, served=identity, candidates="auto", prefilter="auto", recall_target=0.995,
                 use_triton=False)
    assert index.candidates == dict.fromkeys(range(4), 64)
    assert index.prefilter == {0: 8, 1: 2, 2: 2, 3: 2}
    assert {layer: group.c1 // group.candidates for layer, group in index.groups.items()} == index.prefilter
    assert "decode stage 1: 2 x C (layers 1-3), 8 x C (layers 0); decode points: " in index.describe()
    assert serve(paths, net, served=identity, use_triton=False).prefilter == index.prefilter  # the default: auto
    with index:
        _generate(net, _text(3000, 400), 3)
    # the fold scan's points too: the layer only they serve gets them (the torch path scores them here)
    folded = dict(staged)
    folded.update({f"layer0/k{TOPK}/prefilter{p}@{c}": 0.9 for p in (2, 8) for c in (64, 128, 256)})
    folded.update({f"layer{layer}/k{TOPK}/folds1@{c}": 0.999 for layer in range(4) for c in (64, 128, 256)})
    folded_paths = _bundles(tmp_path / "folded", net, identity, ivf=False, pq_metrics=folded)
    index = serve(folded_paths, net, served=identity, use_triton=False, measure_recall=True)
    assert index.stage1 == {0: "folds", 1: "codes", 2: "codes", 3: "codes"}
    assert index.prefilter == {0: 1, 1: 2, 2: 2, 3: 2} and index.candidates == dict.fromkeys(range(4), 64)
    assert {layer: group.stage1 for layer, group in index.groups.items()} == index.stage1
    assert "decode stage 1 by: codes (layers 1-3), folds (layers 0)" in index.describe()
    assert "layer 0: C = 64, stage 1 1 x C by folds, held-out recall 99.90%" in index.describe()
    with index:
        _generate(net, _text(3000, 400), 3)
    assert index.log.recall()["decode"][0] > 0.5  # the folds' step selected layer 0's decode queries
    with pytest.raises(DsaIndexError, match=r"Layer 0 .* at most 90\.00%.* by codes") as err:
        serve(folded_paths, net, served=identity, use_triton=False, stage1="codes")
    assert "serve stage 1 by folds" in err.value.fix
    with pytest.raises(DsaIndexError, match="together with its C"):
        serve(paths, net, served=identity, candidates=64, prefilter="auto")
    with pytest.raises(DsaIndexError, match=r"No stage-1 prefilter for decode layers \[1, 2, 3\]"):
        serve(paths, net, served=identity, candidates=64, prefilter={0: 4}, use_triton=False)
    with pytest.raises(DsaIndexError, match=r"No candidate count C for decode layers \[0, 3\]"):
        serve(paths, net, served=identity, candidates={1: 64, 2: 64}, use_triton=False)


def test_decode_c_grows_past_the_band_the_bundle_measured(served, tmp_path):
    """``long_prefix="grow"`` (the default): each decode group grows C past the end of the longest prefix band
    its bundle records the served recall in, and the startup points say so; a server whose steps may be
    cached ones (more slots than ``direct_upto``) sizes its device cache for the growth and says so; ``fixed``
    keeps C and its cache and says that."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.kernels.pq_select import growth_of
    from dsaindex.runtime.settings import DecodeSettings

    net, _, identity = served
    metrics = {}
    for layer in range(4):
        metrics.update({f"layer{layer}/k{TOPK}/prefilter2@64": 0.999, f"layer{layer}/k{TOPK}@1K-2K/prefilter2@64": 0.998,
                        f"layer{layer}/k{TOPK}@1K-2K/queries": 20.0})
    paths = _bundles(tmp_path, net, identity, ivf=False, pq_metrics=metrics)
    index = serve(paths, net, served=identity, use_triton=False)
    assert {layer: group.grow_band for layer, group in index.groups.items()} == dict.fromkeys(range(4), 2048)
    assert "held-out recall 99.80% at prefixes up to 2K; past 2K C doubles with each doubling of the prefix" \
        in index.describe()
    with index:  # a 3,000-token prompt: its decode steps keep 2 x C
        _generate(net, _text(3000, 400), 2)
    assert "rescores every grown candidate" not in index.describe()  # one slot: every step is direct already
    wide = serve(paths, net, served=identity, use_triton=False, slots=3)
    assert {group.grow_band for group in wide.groups.values()} == {2048}
    group = wide.groups[0]  # its device cache sized for the most C grows for its longest request
    assert group.cache_capacity == group.base_cache * growth_of(group.max_keys, group.grow_band, group.grow_most) > \
        group.base_cache
    assert (f"a step of more than 2 requests whose longest is past its band rescores every grown candidate (no miss "
            f"filter), through a device cache sized for the growth ({group.cache_capacity:,} rows, ") in wide.describe()
    kept = serve(paths, net, served=identity, use_triton=False, long_prefix="fixed", slots=3)
    assert {group.grow_band for group in kept.groups.values()} == {0}
    assert {group.cache_capacity for group in kept.groups.values()} == {kept.groups[0].base_cache}
    assert "(longer ones not measured; C stays fixed there)" in kept.describe()
    assert "rescores every grown candidate" not in kept.describe()
    with pytest.raises(DsaIndexError, match="long_prefix 'double' is not a rule"):
        DecodeSettings(long_prefix="double")


def test_serve_takes_a_count_or_auto_for_candidates():
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.commands.serve import parse_candidates, parse_prefilter

    assert parse_prefilter("16", 2048) == 16 and parse_prefilter(" Auto", "auto") == "auto"
    with pytest.raises(DsaIndexError, match="together with its C"):
        parse_prefilter("auto", 2048)
    for bad in ("0", "x", "-4"):
        with pytest.raises(DsaIndexError, match="neither a positive factor nor `auto`"):
            parse_prefilter(bad, "auto")

    assert parse_candidates("auto") == "auto" and parse_candidates(" AUTO ") == "auto"
    assert parse_candidates("2048") == 2048
    for bad in ("0", "-3", "2k", ""):
        with pytest.raises(DsaIndexError, match="neither a positive count nor `auto`"):
            parse_candidates(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_answers_a_completion_over_http(served, tmp_path):
    """``dsaindex serve`` starts transformers' server with the runtime installed; an OpenAI client on
    loopback gets the same tokens as in-process generation with the same runtime."""
    openai = pytest.importorskip("openai")

    net, paths, identity = served
    prompt_text = inspect.getsource(inspect)[0:300]
    port = _free_port()
    cmd = [sys.executable, "-m", "dsaindex", "serve", "--model", "reference-v1", "--topk", str(TOPK), "--port", str(port),
           "--candidates", "64", "--ivf-budget", "256", "--model-id", "dsaindex/reference"]
    for p in paths:
        cmd += ["--artifacts", str(p)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 240
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail(f"the server did not start:\n{server.stdout.read()}")
                time.sleep(1)
        reply = client.completions.create(model="dsaindex/reference", prompt=prompt_text, max_tokens=8, temperature=0)
        text = reply.choices[0].text
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[0]
    assert "prefill ivf: layers 0-3; decode pq: layers 0-3" in log
    prompt = torch.tensor([256] + list(prompt_text.encode()), dtype=torch.long)
    with serve(paths, net, served=identity, candidates=64, ivf_budget=256, use_triton=False):
        want = _generate(net, prompt, 8)
    assert reply.usage.completion_tokens == 8
    assert text == bytes(t for t in want.tolist() if t < 256).decode("utf-8", "replace"), json.dumps(reply.model_dump())


def test_serve_refuses_artifacts_of_another_model_before_the_port_opens(served, tmp_path):
    from dsaindex.artifacts.fingerprint import fingerprint_model
    from dsaindex.pipelines.capture.models import load_model

    net, _, _ = served
    other = load_model("reference-v1", dtype="float32").model
    with torch.no_grad():
        other.model.layers[0].self_attn.indexer.wk.weight.mul_(1.01)
    (bundle,) = _bundles(tmp_path, net, fingerprint_model(other, "reference-v1"), ivf=False)
    port = _free_port()
    result = subprocess.run([sys.executable, "-m", "dsaindex", "serve", "--model", "reference-v1", "--artifacts",
                             str(bundle), "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "Fix:" in result.stderr
    with socket.socket() as s:  # nothing listens there
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_streamed_prefill_selects_as_the_resident_cache_does(served):
    """With the model's indexer keys streamed from host memory through two buffers, generation and the
    model's own selections are those of the resident cache; the cache holds no indexer keys, the host
    holds them all, the device holds two layers' buffers."""

    net, paths, identity = served
    prompt = _text(7000, 400)
    settings = dict(served=identity, candidates=2 * TOPK, use_triton=False, measure_recall=True)
    resident = serve(paths[:1], net, **settings)  # PQ decode; prefill is the model's own, from its keys
    with resident:
        want = net.generate(prompt.unsqueeze(0), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    streamed = serve(paths[:1], net, stream_prefix=True, max_keys=1024, **settings)
    with streamed:
        got = net.generate(prompt.unsqueeze(0), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert streamed.log.recall() == resident.log.recall()  # the same choices, layer by layer
    n = want.past_key_values.layers[0].indexer_keys.shape[1]
    for layer in range(4):
        assert got.past_key_values.layers[layer].indexer_keys is None  # nothing resident in the cache
        held = streamed.streamer.host[layer][: streamed.streamer.length[layer]]
        torch.testing.assert_close(held, want.past_key_values.layers[layer].indexer_keys[0, : held.shape[0]])
        assert streamed.streamer.length[layer] == n  # every key, written back
    assert streamed.streamer.device_bytes() == 2 * 1024 * 128 * 4
    with pytest.raises(Exception, match="one request at a time"):
        serve(paths[:1], net, stream_prefix=True, slots=2, **settings)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_streamed_ivf_keys_select_as_resident_ones_and_leave_the_device_between_chunks(served, device):
    """With streamed prefill the IVF indexes' FP8 key bytes stream too: chunk after chunk each layer's index
    borrows its buffer, so generation and every selection equal the resident indexes', while the peak
    of prefill index bytes drops to two buffers plus per-key scales, versions and bounds. On CUDA: copies
    on the copy stream, the Triton selection reading the borrowed buffer."""
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, paths, identity = served
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        net = load_model("reference-v1", dtype="float32", device="cuda").model
        set_index_topk(net, TOPK)
    prompt = _text(5000, 700)
    runs = {}
    for streamed in (False, True):
        runs[streamed] = greedy_agreement(net, {}, prompt, 4, selection=lambda streamed=streamed: serve(
            paths, net, served=identity, candidates=4 * TOPK, prefilter=2, ivf_budget=4 * TOPK,
            use_triton=device == "cuda", measure_recall=True, stream_prefix=streamed, max_keys=1024),
            prefill_chunk=256, device=device)
    resident, streamed = runs[False], runs[True]
    if device == "cpu":
        assert streamed["runtime_text"] == resident["runtime_text"]
        assert streamed["selection_recall"] == resident["selection_recall"]  # the same choices, layer by layer
    else:  # k-means sums with atomics on the GPU: two builds may group a few keys differently
        for phase, layers in resident["selection_recall"].items():
            for layer, recall in layers.items():
                assert abs(streamed["selection_recall"][phase][layer] - recall) <= 0.02, (phase, layer)
    assert resident["selection_recall"]["prefill"]["0"] < 1.0  # a budget that routes (not every key)
    n = prompt.numel()
    peak, before = streamed["index_bytes"]["prefill_index_peak"], resident["index_bytes"]["prefill_index_peak"]
    buffers = 2 * 1024 * 128
    assert streamed["index_bytes"]["prefill_index_keys"] == resident["index_bytes"]["prefill_index_keys"] == 4 * n
    # streaming saves each layer's 128 FP8 bytes a key (at least), and holds the two buffers and one
    # layer's dequantized prefix; the scales, versions and bounds stay on the device in both
    assert before - peak >= 4 * n * 128 - buffers
    assert peak >= buffers + 4 * n * 4 + n * 128 * 4


def test_cross_layer_reuse_takes_the_kept_layers_selection(served):
    """With a reuse plan, a layer attends the selection its kept layer made in the same forward, and the
    log says how much of its own top-k that keeps; a plan pointing forward is refused."""
    from dsaindex.errors import ArtifactMismatchError
    from dsaindex.runtime.serving import ServedIndex

    net, _, _ = served
    index = ServedIndex(net, {}, {}, ServeSettings.of(measure_recall=True, use_triton=False), reuse={0: 0, 1: 0, 3: 2})
    assert index.describe().endswith("reuse: 1 <- 0, 3 <- 2")
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    with index:
        handles = [net.model.layers[i].self_attn.indexer.register_forward_hook(
            lambda mod, args, out, i=i: seen[i].append(out.clone())) for i in range(4)]
        try:
            _generate(net, _text(11_000, 300), 4)
        finally:
            for h in handles:
                h.remove()
    assert len(seen[1]) == 4  # the prompt, then a forward per new token but the last
    for a, b in zip(seen[1], seen[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(seen[3], seen[2], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(seen[2][0], seen[0][0])  # kept layers still choose for themselves
    recall = index.log.recall()
    assert set(recall["prefill"]) == {1, 3} and set(recall["decode"]) == {1, 3}
    assert all(0.0 < r < 1.0 for r in recall["prefill"].values()), recall
    with pytest.raises(ArtifactMismatchError, match="not earlier indexer layers"):
        ServedIndex(net, {}, {}, reuse={1: 2})


def test_mli_lag_attends_the_previous_kept_layers_selection(served):
    """Under the Multi-layer Indexer's lag, a layer attends the selection the nearest kept layer before it
    made in the same forward (a kept layer too), while kept layers still compute their own for the next."""
    from dsaindex.artifacts.kinds import lagged_sources
    from dsaindex.runtime.serving import ServedIndex

    assert lagged_sources([0, 1, 2, 3], [0, 1, 2, 3]) == [0, 0, 1, 2]  # MLI alone
    assert lagged_sources([0, 1, 2, 3], [0, 2]) == [0, 0, 0, 2]  # IndexCache 1/2 + MLI: 2 attends 0
    net, _, _ = served
    index = ServedIndex(net, {}, {}, ServeSettings.of(use_triton=False, lag=True), reuse={1: 0, 3: 2})
    assert index.attend == {1: 0, 2: 0, 3: 2}
    assert index.describe().endswith("attends (MLI lag): 1 <- 0, 2 <- 0, 3 <- 2")
    own: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    attended: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    indexers = [net.model.layers[i].self_attn.indexer for i in range(4)]
    # hooks run in the order they were registered: before the runtime's, the model's own selection; after
    # it, what the layer attends
    handles = [m.register_forward_hook(lambda mod, args, out, i=i: own[i].append(out.clone()))
               for i, m in enumerate(indexers)]
    try:
        with index:
            handles += [m.register_forward_hook(lambda mod, args, out, i=i: attended[i].append(out.clone()))
                        for i, m in enumerate(indexers)]
            _generate(net, _text(11_000, 300), 4)
    finally:
        for h in handles:
            h.remove()
    assert len(attended[3]) == 4  # the prompt, then a forward per new token but the last
    for layer, source in ((0, 0), (1, 0), (2, 0), (3, 2)):
        for a, b in zip(attended[layer], own[source], strict=True):
            assert torch.equal(a, b), (layer, source)
    assert not torch.equal(own[2][0], own[0][0])  # kept layer 2 still chooses its own, for layer 3


@pytest.mark.gpu
def test_mli_on_a_side_stream_selects_as_the_lag_in_line(served):
    """On a CUDA device the lagged kept layers' selections run on a side stream, joined where a later
    layer attends them: generation equals the same lag computed in line, with the model's own indexers
    under a plan and with PQ decode on every layer."""
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime.serving import ServedIndex

    _, paths, identity = served
    net = load_model("reference-v1", dtype="float32", device="cuda").model
    set_index_topk(net, TOPK)
    prompt = _text(11_000, 300).cuda()
    for make in (lambda side: ServedIndex(net, {}, {}, ServeSettings.of(lag=True, side_stream=side), reuse={1: 0, 3: 2}),
                 lambda side: serve(paths[:1], net, served=identity, lag=True, side_stream=side, candidates=2 * TOPK)):
        tokens = {}
        for side in (False, True):
            index = make(side)
            assert (index.side is not None) == side
            with index:
                tokens[side] = _generate(net, prompt, 8)
            assert not index._done and index._main is None
        assert torch.equal(tokens[True], tokens[False])
    assert make(True).forked == {1, 2}  # MLI alone: layer 3's own selection is attended by no layer
    with pytest.raises(Exception, match="side stream"):
        ServedIndex(net, {}, {}, ServeSettings.of(side_stream=True))


def test_a_reuse_bundle_is_served_by_its_chosen_plan(served, tmp_path):
    import numpy as np

    from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
    from dsaindex.errors import DsaIndexError
    from dsaindex.geometry import geometry_from_config
    from dsaindex.train.reuse import make_plans

    net, paths, identity = served
    overlap = np.array([[1, .9, .2, .1], [.8, 1, .3, .2], [.3, .4, 1, .9], [.2, .3, .8, 1]], dtype=np.float32)
    plans = make_plans(overlap, [0, 1, 2, 3])
    params = {"plans_in_layer": 0, "layers": [0, 1, 2, 3], "topk": TOPK, "plans": [p.model_dump() for p in plans]}
    layers = {"0": LayerArtifact(kind="reuse", params=params)}
    layers |= {str(i): LayerArtifact(kind="reuse", params={"plans_in_layer": 0}) for i in (1, 2, 3)}
    lineage = Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                      train_sequences=[0], eval_sequences=[1])
    manifest = new_bundle_manifest(identity, "hadamard", geometry_from_config(net.config).key_format, layers, lineage)
    write_bundle(tmp_path / "reuse", manifest, {0: {"overlap": overlap}})
    index = serve([paths[0], tmp_path / "reuse"], net, served=identity, retention="1/2", use_triton=False,
                  candidates=2 * TOPK)
    best = next(p for p in plans if p.retention == "1/2" and p.method == "optimal")
    assert best.kept == [0, 2]  # layers 1 and 3 overlap most with 0 and 2
    assert index.reuse == {1: 0, 3: 2} and set(index.groups) == {0, 2}  # reusing layers hold no state
    assert index.paths()[3].decode == "reuse 2"
    with pytest.raises(DsaIndexError, match="no retention was chosen"):
        serve([tmp_path / "reuse"], net, served=identity, candidates=2 * TOPK)


def test_greedy_agreement_serves_whole_requests_in_prefill_chunks(served):
    """`runtime generate --ivf-artifacts`'s measurement: a fresh served index per run, the prompt fed in
    chunks (IVF prefill chunk after chunk), recall reported per phase. With budgets that cover every key
    the runtime is the model's own selection: every token agrees and recall is 1 up to FP8 near-ties."""
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, paths, identity = served
    prompt = _text(2000, 400)
    # budgets past the 405 keys of the longest run (a larger IVF budget only pads each query's candidate
    # list with unused rows, which the CPU refine scores all the same)
    chunked = greedy_agreement(net, {}, prompt, 4, selection=lambda: serve(
        paths, net, served=identity, candidates=1024, prefilter=2, ivf_budget=512, use_triton=False,
        measure_recall=True), prefill_chunk=256)
    assert chunked["free_running"]["token_agreement"] == 1.0
    assert chunked["teacher_forced"]["token_agreement"] == 1.0
    recall = chunked["selection_recall"]
    assert set(recall) == {"prefill", "decode"} and set(recall["prefill"]) == {"0", "1", "2", "3"}
    # both phases rescore FP8 keys (the model scores bf16 ones): near-ties at top-32 differ
    assert min(recall["prefill"].values()) >= 0.97 and min(recall["decode"].values()) >= 0.95
    # the prefill indexes' peak: every layer's prompt keys in FP8 (132 B) with one layer's dequantized
    # prefix, well under the float32 copy alone (512 B a key) that they kept before
    memory, n = chunked["index_bytes"], prompt.numel()
    assert memory["prefill_index_keys"] == 4 * n
    assert 4 * n * 132 + n * 128 * 4 <= memory["prefill_index_peak"] < 4 * n * 512
    assert memory["decode_state"] > 0
    whole = greedy_agreement(net, {}, prompt, 4, selection=lambda: serve(
        paths, net, served=identity, candidates=1024, prefilter=2, ivf_budget=512, use_triton=False,
        measure_recall=True))
    assert whole["runtime_text"] == chunked["runtime_text"]  # chunking the prompt changes no token here


@pytest.mark.parametrize("stream_prefix", [False, True])
def test_where_the_runtime_selects_the_models_own_scores_are_never_computed(served, monkeypatch, stream_prefix):
    """IVF prefill and PQ decode replace the model's selection, so the model's own indexer forward (every
    query scored against every key, [B, S, H, T] fp32: what made long prompts run out of memory) does not
    run; the model's key cache still takes every key, and the tokens are those of the same runtime with the
    model's forward run (measure_recall reads the model's choice)."""
    net, paths, identity = served
    prompt = _text(3000, 300)
    cls = type(net.model.layers[0].self_attn.indexer)
    original, calls = cls.forward, []

    @functools.wraps(original)  # the hooks bind arguments by the forward's signature
    def counted(self, hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[1])
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    runs = {}
    for measure in (True, False):
        calls.clear()
        index = serve(paths, net, served=identity, candidates=2 * TOPK, ivf_budget=4 * TOPK, use_triton=False,
                      measure_recall=measure, stream_prefix=stream_prefix, max_keys=1024)
        with index:
            out = net.generate(prompt.unsqueeze(0), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        runs[measure] = (out, list(calls))
    (lean, lean_calls), (full, full_calls) = runs[False], runs[True]
    assert torch.equal(lean.sequences, full.sequences)
    assert sorted(full_calls) == [1] * (4 * 5) + [prompt.numel()] * 4  # with measure_recall: every layer, every step
    assert lean_calls == []  # otherwise: none
    if not stream_prefix:
        for layer in range(4):  # the cache holds every key all the same
            torch.testing.assert_close(lean.past_key_values.layers[layer].indexer_keys,
                                       full.past_key_values.layers[layer].indexer_keys)
    assert not any("forward" in vars(m.self_attn.indexer) for m in net.model.layers)  # unwrapped on exit


def test_a_request_with_fewer_keys_than_top_k_attends_every_key_without_the_models_forward(served, monkeypatch):
    """Below top-k keys the placeholder the runtime answers with (every key position) is the model's own
    choice: the same tokens as exhaustive selection, and the model's forward never runs."""
    net, paths, identity = served
    prompt = _text(5000, TOPK - 10)
    want = _generate(net, prompt, 6)  # positions TOPK - 10 ... TOPK - 5: fewer keys than top-k throughout
    cls = type(net.model.layers[0].self_attn.indexer)
    original, calls = cls.forward, []
    monkeypatch.setattr(cls, "forward", functools.wraps(original)(
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k)))
    with serve(paths, net, served=identity, candidates=2 * TOPK, use_triton=False):
        got = _generate(net, prompt, 6)
    assert torch.equal(got, want) and calls == []
