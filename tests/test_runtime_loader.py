"""Server-side loading: resolve a bundle, verify it, validate it against the served model, place it."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
from dsaindex.errors import CorruptBundleError
from dsaindex.geometry import geometry_from_config
from dsaindex.pipelines.capture.models import preset_config
from dsaindex.runtime import check_bundle_for_model, load_bundle
from dsaindex.runtime.loader import ArtifactMismatchError
from helpers import run_cli


def preset_fingerprint(preset="tiny-v32"):
    """The fingerprint a capture of a preset records (float32 on the CPU)."""
    from dsaindex.pipelines.capture.models import load_model

    return load_model(f"preset:{preset}").fingerprint


def pq_bundle(path, preset="tiny-v32", layers=None, basis="hadamard", subspaces=32, seed=0, model=None,
              rotations=None, rotate=None, metrics=None):
    """A PQ bundle for a preset's geometry, with random codebooks, trained (so its manifest says) for
    ``model`` (default: the preset's own fingerprint). ``rotations``: layer -> array stored as the layer's
    ``rotation`` (OPQ); ``rotate``: the layers whose params say rotate=true (default: those with one)."""
    geometry = geometry_from_config(preset_config(preset))
    model = model or preset_fingerprint(preset)
    layer_ids = geometry.indexer_layers if layers is None else layers
    rng = np.random.default_rng(seed)
    sub = geometry.head_dim // subspaces
    arrays = {i: {"codebooks": rng.standard_normal((subspaces, 256, sub)).astype(np.float32),
                  "metric": np.tile(np.eye(sub, dtype=np.float32), (subspaces, 1, 1))} for i in layer_ids}
    rotations = rotations or {}
    for i, rotation in rotations.items():
        arrays[i]["rotation"] = rotation
    rotate = set(rotations) if rotate is None else set(rotate)
    manifest = new_bundle_manifest(
        model, basis, geometry.key_format,
        {str(i): LayerArtifact(kind="pq", params={"subspaces": subspaces, "score_aware": True, "rotate": i in rotate})
         for i in layer_ids},
        Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                train_sequences=[0], eval_sequences=[1]),
        metrics=metrics,
    )
    write_bundle(path, manifest, arrays)
    return arrays


def test_load_places_codebooks_and_reports_startup(tmp_path):
    arrays = pq_bundle(tmp_path / "b")
    loaded = load_bundle(tmp_path / "b", preset_config("tiny-v32"))
    assert sorted(loaded.layers) == [0, 1, 2, 3]
    for i, layer in loaded.layers.items():
        assert layer.codebooks.dtype == torch.float32 and layer.codebooks.shape == (32, 256, 4)
        np.testing.assert_array_equal(layer.codebooks.numpy(), arrays[i]["codebooks"])
        assert layer.metric is not None and layer.subspaces == 32
    assert loaded.device_bytes == 4 * (32 * 256 * 4 + 32 * 16) * 4
    assert 0 < loaded.startup_seconds < 30
    assert loaded.summary()["layers"]["3"]["score_aware"] is True


def orthogonal(dim, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((dim, dim)))
    return q.astype(np.float32)


def test_an_opq_bundle_loads_its_rotations_and_a_bundle_without_them_is_refused(tmp_path):
    rotations = {i: orthogonal(128, i) for i in (0, 2)}
    arrays = pq_bundle(tmp_path / "opq", rotations=rotations)
    loaded = load_bundle(tmp_path / "opq", preset_config("tiny-v32"))
    for i, layer in loaded.layers.items():
        if i in rotations:
            np.testing.assert_array_equal(layer.rotation.numpy(), rotations[i])
        else:
            assert layer.rotation is None
    assert loaded.device_bytes == 4 * (32 * 256 * 4 + 32 * 16) * 4 + 2 * 4 * 128 * 128
    assert loaded.summary()["layers"]["2"]["rotate"] is True and loaded.summary()["layers"]["1"]["rotate"] is False
    assert "0 (OPQ32 score-aware), 1 (PQ32 score-aware)" in loaded.describe_layers()
    np.testing.assert_array_equal(loaded.layers[0].codebooks.numpy(), arrays[0]["codebooks"])
    # params say rotate, the array is missing: refused, naming the layer and the array
    pq_bundle(tmp_path / "missing", rotations={0: rotations[0]}, rotate=(0, 3))
    with pytest.raises(CorruptBundleError, match=r"layer 3: .*rotate=true.*no 'rotation' array") as err:
        load_bundle(tmp_path / "missing", preset_config("tiny-v32"))
    assert "dsaindex train pq" in err.value.fix and "OPQ by default" in err.value.fix
    # an array without the params' word, a wrong shape, a matrix that is not a rotation: refused as well
    pq_bundle(tmp_path / "unsaid", rotations={1: rotations[0]}, rotate=())
    with pytest.raises(CorruptBundleError, match="layer 1: .*do not say rotate=true"):
        load_bundle(tmp_path / "unsaid", preset_config("tiny-v32"))
    pq_bundle(tmp_path / "shape", rotations={2: rotations[0][:64, :64].copy()})
    with pytest.raises(CorruptBundleError, match=r"layer 2: .*shape \[64, 64\].*must be \[128, 128\]"):
        load_bundle(tmp_path / "shape", preset_config("tiny-v32"))
    pq_bundle(tmp_path / "scaled", rotations={2: 2 * rotations[2]})
    with pytest.raises(CorruptBundleError, match="layer 2: .*not orthogonal"):
        load_bundle(tmp_path / "scaled", preset_config("tiny-v32"))


def test_loading_a_local_bundle_does_not_import_mlflow(tmp_path):
    pq_bundle(tmp_path / "b")
    code = ("import sys, json; from dsaindex.runtime import load_bundle; from dsaindex.pipelines.capture.models import preset_config; "
            f"load_bundle({str(tmp_path / 'b')!r}, preset_config('tiny-v32')); "
            "print(json.dumps([m for m in ('mlflow', 'faiss') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("preset,needle", [("tiny-glm5", "family"), ("tiny-v4", "family")])
def test_artifacts_of_another_family_are_refused(tmp_path, preset, needle):
    pq_bundle(tmp_path / "b")
    with pytest.raises(ArtifactMismatchError, match=needle) as err:
        load_bundle(tmp_path / "b", preset_config(preset))
    assert "deepseek_v32" in str(err.value) and "Fix:" in str(err.value)


def test_missing_layers_and_basis_are_refused(tmp_path):
    pq_bundle(tmp_path / "partial", layers=(0, 1, 2))
    with pytest.raises(ArtifactMismatchError, match=r"missing \[3\]"):
        load_bundle(tmp_path / "partial", preset_config("tiny-v32"))
    pq_bundle(tmp_path / "raw", basis="raw")
    with pytest.raises(ArtifactMismatchError, match="basis"):
        load_bundle(tmp_path / "raw", preset_config("tiny-v32"))
    assert load_bundle(tmp_path / "raw", preset_config("tiny-v32"), basis="raw").manifest.basis == "raw"


def test_dims_and_schema_version_are_checked(tmp_path):
    pq_bundle(tmp_path / "b")
    from dsaindex.artifacts.bundle import read_manifest

    manifest = read_manifest(tmp_path / "b")
    config = preset_config("tiny-v32")
    config.index_n_heads = 16
    with pytest.raises(ArtifactMismatchError, match="heads is 8"):
        check_bundle_for_model(manifest, config)
    with pytest.raises(ArtifactMismatchError, match="schema version 2"):
        check_bundle_for_model(manifest.model_copy(update={"schema_version": 2}), preset_config("tiny-v32"))


def test_corrupt_bundle_is_refused(tmp_path):
    pq_bundle(tmp_path / "b")
    chunk = next(p for p in (tmp_path / "b").rglob("*") if p.is_file() and "codebooks" in str(p) and "zarr.json" not in p.name)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptBundleError):
        load_bundle(tmp_path / "b", preset_config("tiny-v32"))


def test_runtime_check_cli(tmp_path):
    pq_bundle(tmp_path / "b")
    ok = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"), "--json", "--prefilter", "4")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["family"] == "deepseek_v32"
    bad = run_cli("runtime", "check", "-m", "preset:tiny-v4", "-a", str(tmp_path / "b"))
    assert bad.returncode == 2 and "error:" in bad.stderr and "Fix:" in bad.stderr


def test_runtime_check_reports_the_candidates_serve_would_choose(tmp_path):
    """``runtime check`` says which C ``serve --candidates auto`` would give each layer at the recall target,
    or that it would refuse, from the bundle's recorded held-out recall (top-k of the tiny preset: 32)."""
    layers = geometry_from_config(preset_config("tiny-v32")).indexer_layers
    topk = geometry_from_config(preset_config("tiny-v32")).topk
    metrics = {}
    for layer in layers:
        low = layer == layers[0]
        metrics.update({f"layer{layer}/k{topk}/rerank@128": 0.97 if low else 0.999,
                        f"layer{layer}/k{topk}/rerank@256": 0.998 if low else 1.0})
    pq_bundle(tmp_path / "b", metrics=metrics)
    ok = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"), "--json", "--prefilter", "4")
    assert ok.returncode == 0, ok.stderr
    auto = json.loads(ok.stdout)["candidates_auto"]
    assert auto == {"target": 0.995, "prefilter": 4,
                    "per_layer": {str(layer): 256 if layer == layers[0] else 128 for layer in layers}}
    text = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"), "--recall-target", "0.99",
                   "--prefilter", "4")
    assert text.returncode == 0, text.stderr
    rest = ", ".join(str(layer) for layer in layers[1:])
    assert f"--candidates auto at 99.00% held-out recall (prefilter 4): C = 128 (layers {rest}), C = 256 (layers {layers[0]})" in text.stdout
    strict = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"), "--recall-target", "0.999")
    assert strict.returncode == 2 and "a server would refuse to start" in strict.stdout  # not a pass
    as_json = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"), "--recall-target", "0.999",
                      "--json")
    assert as_json.returncode == 2 and "refused" in json.loads(as_json.stdout)["candidates_auto"]
    assert f"Layer {layers[0]} of {tmp_path / 'b'} reaches at most 99.80%" in strict.stdout
    # with the served step's recall recorded, the C depends on the server's prefilter
    staged = dict(metrics)
    for layer in layers:
        staged.update({f"layer{layer}/k{topk}/prefilter4@128": 0.96, f"layer{layer}/k{topk}/prefilter4@256": 0.996,
                       f"layer{layer}/k{topk}/prefilter16@128": 0.998, f"layer{layer}/k{topk}/prefilter16@256": 1.0})
    pq_bundle(tmp_path / "staged", metrics=staged)
    for prefilter, c in (("4", 256), ("16", 128)):
        out = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "staged"), "--json",
                      "--prefilter", prefilter)
        assert json.loads(out.stdout)["candidates_auto"]["per_layer"] == {str(layer): c for layer in layers}
    # `auto`: stage 1 and C together, the least stage-2 work (4 x 256 = 1,024 keys against 16 x 128 = 2,048)
    both = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "staged"), "--prefilter", "auto")
    assert both.returncode == 0, both.stderr
    assert f"C = 256 (layers {', '.join(map(str, layers))}); stage 1 4 x C (layers" in both.stdout
    assert "grows_past" not in json.loads(out.stdout)["candidates_auto"] and "doubles" not in both.stdout
    # a bundle whose served recall is recorded in a prefix band: C grows past its end (the servers' default)
    banded = dict(staged)
    for layer in layers:
        banded.update({f"layer{layer}/k{topk}@64K-128K/prefilter4@256": 0.996, f"layer{layer}/k{topk}@64K-128K/queries": 20})
    pq_bundle(tmp_path / "banded", metrics=banded)
    grows = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "banded"), "--prefilter", "4")
    assert grows.returncode == 0, grows.stderr
    assert f"; C doubles with each doubling of the prefix past 131,072 keys (layers {', '.join(map(str, layers))})" \
        in grows.stdout
    grown = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "banded"), "--prefilter", "4",
                    "--json")
    assert json.loads(grown.stdout)["candidates_auto"]["grows_past"] == {str(layer): 131072 for layer in layers}
    bad = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "staged"), "--prefilter", "x")
    assert bad.returncode == 2 and "neither a positive factor nor `auto`" in bad.stderr
    pq_bundle(tmp_path / "bare")
    bare = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "bare"), "--json")
    # a bundle that records no recall: `auto` cannot choose from it, but the bundle fits (a number of C serves it)
    assert bare.returncode == 0, bare.stderr
    assert "records no held-out recall" in json.loads(bare.stdout)["candidates_auto"]["unmeasured"]


def test_candidates_per_layer_reads_a_count_auto_or_nothing(tmp_path):
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import candidates_per_layer

    geometry = geometry_from_config(preset_config("tiny-v32"))
    layers = geometry.indexer_layers
    metrics = {f"layer{i}/k{geometry.topk}/rerank@{c}": r for i in layers for c, r in ((64, 0.99), (128, 0.999))}
    pq_bundle(tmp_path / "b", metrics=metrics)
    loaded = load_bundle(tmp_path / "b", preset_config("tiny-v32"))
    assert candidates_per_layer("auto", loaded, geometry.topk, 77) == dict.fromkeys(layers, 128)
    assert candidates_per_layer(" AUTO ", loaded, geometry.topk, 77, target=0.98) == dict.fromkeys(layers, 64)
    assert candidates_per_layer("300", loaded, geometry.topk, 77) == dict.fromkeys(layers, 300)
    assert candidates_per_layer("auto", loaded, geometry.topk, 77, layers=[layers[-1], 999]) == {layers[-1]: 128}
    for nothing in (None, "", "0"):
        assert candidates_per_layer(nothing, loaded, geometry.topk, 77) == dict.fromkeys(layers, 77)
    with pytest.raises(DsaIndexError, match="'lots' is neither a positive count nor `auto`"):
        candidates_per_layer("lots", loaded, geometry.topk, 77)


def test_auto_candidates_read_the_served_recall_at_the_servers_prefilter():
    """A bundle that records the served step's recall (stage 1 keeping P x C keys) is read at the server's
    prefilter: the unstaged rerank figure would promise recall the step does not deliver."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import candidates_for_recall

    head = "layer0/k512"
    metrics = {f"{head}/rerank@2048": 0.9996, f"{head}/rerank@4096": 1.0,
               f"{head}/prefilter4@2048": 0.975, f"{head}/prefilter4@4096": 0.992,
               f"{head}/prefilter16@2048": 0.9983, f"{head}/prefilter16@4096": 0.9995}
    assert candidates_for_recall(metrics, [0], 512, 0.995) == {0: 2048}  # no prefilter given: rerank
    assert candidates_for_recall(metrics, [0], 512, 0.99, prefilter=4) == {0: 4096}
    assert candidates_for_recall(metrics, [0], 512, 0.995, prefilter=16) == {0: 2048}
    # 8 is not recorded: read at 4, the largest recorded factor below it (a lower bound)
    assert candidates_for_recall(metrics, [0], 512, 0.99, prefilter=8) == {0: 4096}
    with pytest.raises(DsaIndexError, match=r"at most 99\.20% .* C = 4096 with stage 1 keeping 4 x C keys") as err:
        candidates_for_recall(metrics, [0], 512, 0.995, prefilter=4)
    assert "--prefilter 16 (it reaches 99.83% at C = 2048" in err.value.fix
    with pytest.raises(DsaIndexError, match="none at or below the 2 asked") as err:
        candidates_for_recall(metrics, [0], 512, 0.99, prefilter=2)
    assert "--prefilter 4 or more" in err.value.fix
    with pytest.raises(DsaIndexError, match=r"at most 99\.82% .* short of the 99\.83% asked"):  # rounded down
        candidates_for_recall({f"{head}/rerank@2048": 0.998299}, [0], 512, 0.9983)
    # the prefilter chosen with C: the least stage-2 work P x C at 1M keys, C grown there as the step grows it
    # (8 x past 128K, to at most 16,384: 2,048 and 4,096 both reach it), on a tie the smaller C (less to rescore)
    from dsaindex.runtime.loader import selection_for_recall

    staged = dict(metrics, **{f"{head}/prefilter8@2048": 0.99, f"{head}/prefilter8@4096": 0.996})
    # stage 2's keys at 1M (C grown to 16,384 either way): 4 x 4,096 -> 64K, cheaper than 8 x 2,048 -> 128K
    assert selection_for_recall(staged, [0], 512, 0.99) == {0: ("codes", 4, 4096)}
    # 8 x 2,048 falls short of 99.5%; 8 x 4,096 (128K keys at 1M) costs half of 16 x 2,048 (256K)
    assert selection_for_recall(staged, [0], 512, 0.995) == {0: ("codes", 8, 4096)}
    assert selection_for_recall(staged, [0], 512, 0.9995) == {0: ("codes", 16, 4096)}
    with pytest.raises(DsaIndexError, match=r"at most 99\.95% .* C = 4096 with stage 1 keeping 16 x C keys by codes"):
        selection_for_recall(staged, [0], 512, 0.9999)
    with pytest.raises(DsaIndexError, match="records no served recall per stage-1 factor"):
        selection_for_recall({f"{head}/rerank@2048": 1.0}, [0], 512, 0.99)
    # the fold scan's points beside the codes': ranked by expected step cost, stage 1's scan and P x C grown
    from dsaindex.runtime.operating_points import expected_step_us

    folded = dict(staged, **{f"{head}/folds1@2048": 0.996, f"{head}/folds1@4096": 0.9993,
                             f"{head}/folds2@2048": 0.9992})
    assert expected_step_us("codes", 4, 4096) < expected_step_us("folds", 1, 2048) < expected_step_us("codes", 8, 4096)
    assert expected_step_us("folds", 1, 2048) == expected_step_us("folds", 1, 4096) < expected_step_us("folds", 2, 2048)
    # C as this server grows it: as ranked past 128K (8 x at 1M, 4,096 capped at 4 x), fixed, or past a shorter band
    assert expected_step_us("codes", 4, 2048) == expected_step_us("codes", 4, 2048, (131072, 8))
    assert expected_step_us("codes", 4, 4096, (0, 1)) < expected_step_us("codes", 4, 4096) == expected_step_us(
        "codes", 4, 4096, (131072, 4))
    assert expected_step_us("codes", 4, 1024, (16384, 16)) > expected_step_us("codes", 4, 1024)
    assert selection_for_recall(folded, [0], 512, 0.99) == {0: ("codes", 4, 4096)}  # the codes' scan is cheaper
    assert selection_for_recall(folded, [0], 512, 0.995) == {0: ("folds", 1, 2048)}  # not 8 x 4096 by codes
    assert selection_for_recall(folded, [0], 512, 0.9992) == {0: ("folds", 1, 4096)}  # half the keys of 2 x 2048
    assert selection_for_recall(folded, [0], 512, 0.995, stage1s=("codes",)) == {0: ("codes", 8, 4096)}
    with pytest.raises(DsaIndexError, match=r"at most 99\.93% .* by folds") as err:
        selection_for_recall(folded, [0], 512, 0.9995, stage1s=("folds",))
    assert "stage 1 by codes" in err.value.fix
    assert candidates_for_recall(folded, [0], 512, 0.995, prefilter=1, stage1="folds") == {0: 2048}
    assert candidates_for_recall(folded, [0], 512, 0.999, prefilter=3, stage1="folds") == {0: 2048}  # read at 2
    with pytest.raises(DsaIndexError, match="records no served recall with stage 1 by folds"):
        candidates_for_recall(staged, [0], 512, 0.995, prefilter=1, stage1="folds")
    # a bundle that records no served recall (trained before it was measured): the rerank figure
    old = {k: v for k, v in metrics.items() if "prefilter" not in k}
    assert candidates_for_recall(old, [0], 512, 0.995, prefilter=4) == {0: 2048}


def test_load_from_the_registry(tmp_path):
    from dsaindex.artifacts.registry import promote, register_bundle

    pq_bundle(tmp_path / "b")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    reg = register_bundle(tmp_path / "b", {"subspaces": 32}, {"mean/recall": 0.9}, [], tracking_uri=uri)
    promote(reg["name"], reg["version"], tracking_uri=uri)
    loaded = load_bundle(f"models:/{reg['name']}@production", preset_config("tiny-v32"), cache_dir=tmp_path / "cache",
                  tracking_uri=uri)
    assert sorted(loaded.layers) == [0, 1, 2, 3] and str(tmp_path / "cache") in str(loaded.path)


def other_checkpoint(path, seed=1):
    """A checkpoint folder of the tiny V3.2 architecture with other random weights (same geometry)."""
    from dsaindex.pipelines.capture.models import load_model

    load_model("preset:tiny-v32", seed=seed).model.save_pretrained(path)
    return path


def test_artifacts_of_another_model_of_the_same_geometry_are_refused(tmp_path):
    from dsaindex.artifacts.compat import config_digest

    pq_bundle(tmp_path / "b")
    served = preset_fingerprint()
    assert served.config_digest == config_digest(preset_config("tiny-v32"))  # the config alone gives the digest
    assert load_bundle(tmp_path / "b", preset_config("tiny-v32"), served=served).layers
    other = served.model_copy(update={"name": "other", "weights_digest": "0" * 16})
    with pytest.raises(ArtifactMismatchError, match=r"weights_digest: artifacts='[0-9a-f]{16}' vs served='0{16}'"):
        load_bundle(tmp_path / "b", preset_config("tiny-v32"), served=other)
    assert load_bundle(tmp_path / "b", preset_config("tiny-v32"), served=other, allow_other_weights=True).layers
    wider = preset_config("tiny-v32")
    # another architecture of the same indexer geometry: only a config to compare
    wider.rope_parameters = {**wider.rope_parameters, "rope_theta": 1234.0}
    with pytest.raises(ArtifactMismatchError, match=r"config_digest.*config fields rope_parameters") as err:
        load_bundle(tmp_path / "b", wider)
    assert "--allow-other-weights" in str(err.value)


def test_artifacts_from_another_transformers_release_serve_and_fields_name_a_real_difference(tmp_path):
    """Releases rename labels (5.17's layer type `deepseek_sparse_attention` is 5.24's `indexed_attention`)
    and add defaulted fields: the config digests differ, the architecture does not. A trained-for model
    recorded that way serves; one whose numbers differ is refused naming the field."""
    from dsaindex.artifacts.compat import check_store_for_model

    served = preset_fingerprint()
    fields = dict(served.config_fields)
    assert fields["num_hidden_layers"] == 4 and "layer_types" in fields
    older_fields = {k: v for k, v in fields.items() if k != "output_router_logits"}
    older_fields["layer_types"] = ["deepseek_sparse_attention"] * len(fields["layer_types"])
    older = served.model_copy(update={"config_digest": "f" * 16, "config_fields": older_fields})
    assert older.same_model(served) and served.same_model(older)
    pq_bundle(tmp_path / "b", model=older)
    assert load_bundle(tmp_path / "b", preset_config("tiny-v32"), served=served).layers
    assert load_bundle(tmp_path / "b", preset_config("tiny-v32")).layers  # config only: compared field by field
    check_store_for_model(older, served, "STORE", "preset:tiny-v32")
    deeper = older.model_copy(update={"config_fields": dict(older_fields, rms_norm_eps=1e-3)})
    assert not deeper.same_model(served)
    pq_bundle(tmp_path / "d", model=deeper)
    with pytest.raises(ArtifactMismatchError, match=r"config fields rms_norm_eps: artifacts=0.001 vs served="):
        load_bundle(tmp_path / "d", preset_config("tiny-v32"), served=served)
    # a fingerprint written before fields were recorded matches by its digest only
    legacy = older.model_copy(update={"config_fields": None})
    assert not legacy.same_model(served)
    assert legacy.model_copy(update={"config_digest": served.config_digest}).same_model(served)


def test_runtime_check_compares_the_weights_of_the_served_model(tmp_path):
    pq_bundle(tmp_path / "b")
    ok = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(tmp_path / "b"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"ok: {tmp_path / 'b'} fits preset:tiny-v32 (same weights and config)")
    ckpt = other_checkpoint(tmp_path / "other")
    bad = run_cli("runtime", "check", "-m", str(ckpt), "-a", str(tmp_path / "b"))
    assert bad.returncode == 2
    first = bad.stderr.splitlines()[0]
    assert first.startswith("error: The artifacts were trained for tiny-v32 (deepseek_v32, weights ")
    assert "but the served model is other" in first and "weights_digest: artifacts=" in first
    assert "config_digest" not in first and "Fix: train artifacts for this model" in first
    allowed = run_cli("runtime", "check", "-m", str(ckpt), "-a", str(tmp_path / "b"), "--allow-other-weights")
    assert allowed.returncode == 0, allowed.stderr
    assert "not compared (--allow-other-weights)" in allowed.stdout
    config_only = run_cli("runtime", "check", "-m", str(ckpt), "-a", str(tmp_path / "b"), "--config-only", "--json")
    assert config_only.returncode == 0, config_only.stderr  # same architecture; the weights were not read
    assert json.loads(config_only.stdout)["model_identity"] == "same config (weights not compared)"


def test_startup_says_each_layers_point_and_the_recall_it_gives_up():
    """What a server prints of its decode layers: the recall recorded at each (C, stage 1) served, the gap to
    the target where a count given by hand falls short of it, and "not recorded" where nothing was measured."""
    from dsaindex.runtime.loader import describe_points

    metrics = {"layer0/k512/prefilter4@1024": 0.990, "layer1/k512/prefilter4@1024": 0.9987,
               "layer2/k512/prefilter4@1024": 0.9987, "layer0/k512/prefilter8@2048": 0.9971}
    said = describe_points(metrics, {0: 1024, 1: 1024, 2: 1024, 3: 1024}, dict.fromkeys(range(4), 4), 512, 0.995)
    assert said == ("layer 0: C = 1024, stage 1 4 x C, held-out recall 99.00%, 0.50 points under the 99.50% target; "
                    "layers 1, 2: C = 1024, stage 1 4 x C, held-out recall 99.87%; "
                    "layer 3: C = 1024, stage 1 4 x C, held-out recall not recorded")
    assert describe_points(metrics, {0: 2048}, {0: 8}, 512) == "layer 0: C = 2048, stage 1 8 x C, held-out recall 99.71%"
    # with prefix bands: the longest well-populated band decides, and its end is said
    banded = {"layer0/k512/prefilter4@4096": 0.997, "layer0/k512@64K-128K/prefilter4@4096": 0.993,
              "layer0/k512@64K-128K/queries": 40, "layer0/k512@128K-256K/prefilter4@4096": 0.90,
              "layer0/k512@128K-256K/queries": 3}
    assert describe_points(banded, {0: 4096}, {0: 4}, 512, 0.995) == (
        "layer 0: C = 4096, stage 1 4 x C, held-out recall 99.30% at prefixes up to 128K (longer ones not measured; "
        "C stays fixed there), 0.20 points under the 99.50% target")


def test_c_grows_past_the_end_of_the_band_each_layers_recall_was_measured_in_and_startup_says_so():
    """``growth_bands``: the keys past which a layer's C grows (the end of the longest well-populated band of its
    served point; 0 with no band, an open-ended band or a point not recorded), and the startup line that says
    how C grows there."""
    from dsaindex.runtime.loader import describe_points, growth_bands

    banded = {"layer0/k512/prefilter4@4096": 0.997, "layer0/k512@64K-128K/prefilter4@4096": 0.996,
              "layer0/k512@64K-128K/queries": 40, "layer0/k512@128K-256K/prefilter4@4096": 0.90,
              "layer0/k512@128K-256K/queries": 3,  # too few queries to count
              "layer1/k512/prefilter4@4096": 0.997, "layer1/k512@1M-max/prefilter4@4096": 0.996,
              "layer1/k512@1M-max/queries": 40, "layer2/k512/prefilter4@4096": 0.997,
              "layer4/k512/prefilter4@4096": 0.997, "layer4/k512@16K-32K/prefilter4@4096": 0.996,
              "layer4/k512@16K-32K/queries": 9}
    layers = {0: 4096, 1: 4096, 2: 4096, 3: 4096, 4: 4096}
    bands = growth_bands(banded, layers, dict.fromkeys(layers, 4), 512)
    assert bands == {0: 128 << 10, 1: 0, 2: 0, 3: 0, 4: 32 << 10}
    assert growth_bands(banded, {0: 4096}, {0: 8}, 512) == {0: 0}  # another stage 1: not recorded
    said = describe_points(banded, {0: 4096, 4: 4096}, {0: 4, 4: 4}, 512, 0.995,
                           grow={0: (bands[0], 4), 4: (bands[4], 2)})
    assert said == ("layer 0: C = 4096, stage 1 4 x C, held-out recall 99.60% at prefixes up to 128K; past 128K C "
                    "doubles with each doubling of the prefix, up to 4 x C = 16,384 past 256K (recall there not "
                    "recorded by the bundle); layer 4: C = 4096, stage 1 4 x C, held-out recall 99.60% at prefixes up "
                    "to 32K; past 32K C doubles with each doubling of the prefix, up to 2 x C = 8,192 past 32K (recall "
                    "there not recorded by the bundle)")
    fixed = describe_points(banded, {0: 4096}, {0: 4}, 512, 0.995, grow={0: (0, 4)})
    assert fixed.endswith("at prefixes up to 128K (longer ones not measured; C stays fixed there)")


def test_startup_prices_each_layers_step_in_bytes_against_the_exact_scan():
    """The cost a server prints beside each point: the bytes a decode query reads against the exact indexer's
    (every key's 132 bytes), from the codes' bytes a key, C and stage 1; cheaper with fewer code bytes or a
    narrower stage 1, and closer to M / 132 as the prefix grows."""
    from dsaindex.runtime.loader import describe_points, step_bytes

    n, m, c, p = 1 << 17, 32, 4096, 8
    cost = step_bytes(n, m, c, p)
    assert cost == {"exact": n * 132, "codes": n * m + p * c * m + c * 132}
    assert step_bytes(1000, m, c, p)["codes"] == 1000 * m + 1000 * m + 1000 * 132  # every key a survivor
    long = step_bytes(1 << 20, m, c, p)
    assert m / 132 < long["codes"] / long["exact"] < cost["codes"] / cost["exact"]
    metrics = {"layer0/k512/prefilter8@4096": 0.9954}
    said = describe_points(metrics, {0: 4096, 1: 4096}, {0: 8, 1: 4}, 512, code_bytes={0: (32, 132), 1: (16, 132)})
    assert said == ("layer 0: C = 4096, stage 1 8 x C, held-out recall 99.54%, a query reads 0.33x the exact scan's "
                    "bytes at 128K keys, 0.25x at 1M; layer 1: C = 4096, stage 1 4 x C, held-out recall not recorded, "
                    "a query reads 0.17x the exact scan's bytes at 128K keys, 0.13x at 1M")


def test_decode_settings_choose_the_fold_scan_only_where_a_layer_serves_it():
    """``stage1="auto"`` takes a layer's cheaper fold-scan point where its codes fit the scan and the scan runs;
    codes of 16 subspaces, or a device where the scan does not build, keep the codes; asking for the folds
    there is refused with the way out."""
    from types import SimpleNamespace

    import torch

    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import decode_settings
    from dsaindex.runtime.settings import DecodeSettings

    metrics = {}
    for layer in (0, 1):
        head = f"layer{layer}/k512"
        metrics |= {f"{head}/prefilter4@2048": 0.99, f"{head}/prefilter16@2048": 0.996, f"{head}/folds1@2048": 0.997}
    codecs = {0: SimpleNamespace(codebooks=torch.zeros(32, 256, 4), residual=False),
              1: SimpleNamespace(codebooks=torch.zeros(16, 256, 8), residual=False)}
    loaded = SimpleNamespace(manifest=SimpleNamespace(metrics=metrics), path="bundle", layers=codecs,
                             kind_of=lambda layer: SimpleNamespace(role="decode"))
    auto = DecodeSettings()
    assert decode_settings(auto, loaded, 512) == ({0: 2048, 1: 2048}, {0: 1, 1: 16}, {0: "folds", 1: "codes"})
    # the scan does not build on this GPU: every layer keeps the codes
    assert decode_settings(auto, loaded, 512, folds="no NVRTC")[2] == {0: "codes", 1: "codes"}
    assert decode_settings(DecodeSettings(stage1="codes"), loaded, 512)[:2] == ({0: 2048, 1: 2048}, {0: 16, 1: 16})
    # a count given: the codes unless the folds are asked for
    assert decode_settings(DecodeSettings(candidates=1024), loaded, 512) == (
        {0: 1024, 1: 1024}, {0: 4, 1: 4}, {0: "codes", 1: "codes"})
    assert decode_settings(DecodeSettings(candidates="auto", prefilter=1, stage1="folds"), loaded, 512,
                           layers=[0]) == ({0: 2048}, {0: 1}, {0: "folds"})
    with pytest.raises(DsaIndexError, match="Layer 1 cannot serve stage 1 by folds: folds score") as err:
        decode_settings(DecodeSettings(stage1="folds"), loaded, 512)
    assert "--stage1 codes" in err.value.fix
    with pytest.raises(DsaIndexError, match="cannot serve stage 1 by folds: no NVRTC"):
        decode_settings(DecodeSettings(stage1={0: "folds", 1: "codes"}), loaded, 512, folds="no NVRTC")
