"""Artifact bundles: round trip, checksums, damaged and foreign folders, atomic writes, store digests."""

import json
import os

import numpy as np
import pytest

from dsaindex.artifacts.bundle import (
    LayerArtifact,
    Lineage,
    array_sha256,
    new_bundle_manifest,
    read_bundle,
    read_manifest,
    store_digest,
    write_bundle,
)
from dsaindex.artifacts.capture_store import (
    CaptureSettings,
    CaptureStore,
    SequenceBatch,
    new_manifest,
)
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.errors import CorruptBundleError, DsaIndexError
from dsaindex.geometry import IndexerGeometry

FINGERPRINT = ModelFingerprint(
    name="hand/tiny-dsa", family="deepseek_v32",
    geometry=IndexerGeometry(family="deepseek_v32", num_layers=5, indexer_layers=(1, 4), n_heads=3, head_dim=8,
                             topk=16, rope_dim=4, rope_layout="half_split_head"),
    config_digest="c0ffee", weights_digest="0123456789abcdef", dtype="bfloat16",
)
LINEAGE = Lineage(capture_store_id="store01", capture_store_path="/data/store", capture_store_digest="ab" * 8,
                  train_sequences=[0, 1, 2], eval_sequences=[3])


def make_arrays(seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Awkward shapes and every dtype a bundle holds, including 0-d and empty arrays."""
    rng = np.random.default_rng(seed)
    return {
        1: {
            "codebooks": rng.standard_normal((7, 19, 3)).astype(np.float32),
            "codes_bits": rng.integers(0, 2**16, (11,), dtype=np.uint16),
            "scale": np.asarray(rng.standard_normal(), dtype=np.float64),
            "empty": np.zeros((0, 5), dtype=np.int8),
        },
        4: {
            "centroids": rng.standard_normal((99, 3)).astype(np.float16),
            "assign": rng.integers(-5, 5, (13, 2), dtype=np.int64),
            "mask": rng.random(9) > 0.5,
            "weights_t": rng.standard_normal((5, 4)).astype(np.float32).T,  # non-contiguous view
        },
    }


def make_manifest(metrics=None):
    layers = {1: LayerArtifact(kind="pq", params={"m": 7, "ksub": 19}),
              4: LayerArtifact(kind="ivf", params={"nlist": 99, "nprobe": 3})}
    return new_bundle_manifest(FINGERPRINT, "hadamard", "bfloat16-bits", layers, LINEAGE,
                               metrics if metrics is not None else {"recall": 0.5, "layer1/recall": 0.75},
                               {"seed": 3, "opt": {"lr": 0.01}})


@pytest.fixture
def bundle(tmp_path):
    path = tmp_path / "bundle"
    arrays = make_arrays()
    return path, write_bundle(path, make_manifest(), arrays), arrays


def chunk_files(array_dir):
    return sorted(p for p in (array_dir / "c").rglob("*") if p.is_file()) if (array_dir / "c").is_dir() else []


def test_round_trip_is_exact(bundle):
    path, written, arrays = bundle
    manifest, back = read_bundle(path)
    assert manifest == written == read_manifest(path)
    assert sorted(back) == [1, 4]
    for layer, named in arrays.items():
        assert sorted(back[layer]) == sorted(named)
        for name, values in named.items():
            got = back[layer][name]
            assert got.dtype == values.dtype and got.shape == values.shape, (layer, name)
            np.testing.assert_array_equal(got, values)
            record = manifest.layers[str(layer)].arrays[name]
            assert record.shape == list(values.shape) and record.dtype == values.dtype.name
            assert record.sha256 == array_sha256(values)
    assert manifest.schema_id == "dsaindex.artifact-bundle" and manifest.schema_version == 1
    assert manifest.layer_ids == [1, 4] and manifest.lineage == LINEAGE
    assert manifest.metrics == {"recall": 0.5, "layer1/recall": 0.75}
    assert [p.name for p in path.parent.iterdir()] == ["bundle"]  # no temporary sibling left


def test_checksum_covers_dtype_and_shape():
    a = np.arange(12, dtype=np.int32)
    assert array_sha256(a) == array_sha256(a.copy())
    assert array_sha256(a) != array_sha256(a.reshape(3, 4))
    assert array_sha256(a) != array_sha256(a.view(np.float32))
    assert array_sha256(a.astype(">i4")) == array_sha256(a)  # byte order does not matter


def test_flipped_byte_in_a_chunk_is_caught(bundle):
    path, _, _ = bundle
    files = chunk_files(path / "layers" / "1" / "codebooks")
    assert files, "the codebooks array has no chunk file"
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(CorruptBundleError) as err:
        read_bundle(path)
    assert "layer 1" in err.value.problem and "'codebooks'" in err.value.problem
    assert err.value.fix


def test_rewritten_array_fails_its_checksum(bundle):
    import zarr

    path, _, arrays = bundle
    group = zarr.open_group(str(path), mode="r+")
    group["layers/4/centroids"][0, 0] = arrays[4]["centroids"][0, 0] + 1
    with pytest.raises(CorruptBundleError, match="layer 4 array 'centroids' fails its sha256"):
        read_bundle(path)
    manifest, back = read_bundle(path, verify=False)  # shapes and dtypes still match
    assert back[4]["centroids"][0, 0] != arrays[4]["centroids"][0, 0]


def test_missing_array_is_named(bundle):
    import shutil

    path, _, _ = bundle
    shutil.rmtree(path / "layers" / "4" / "assign")
    with pytest.raises(CorruptBundleError, match="layer 4 array 'assign' is missing"):
        read_bundle(path)


def _edit_manifest(path, edit):
    meta_file = path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    edit(meta["attributes"]["dsaindex"])
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m.pop("lineage"), "invalid bundle manifest (lineage"),
    (lambda m: m.update(layers={"1": {"kind": "hnsw", "params": {}}}), "invalid bundle manifest (layers.1.kind"),
    (lambda m: m.update(unexpected=1), "invalid bundle manifest (unexpected"),
    (lambda m: m.update(schema_version=99), "schema version 99"),
    (lambda m: m.update(schema_id="something.else"), "not a dsaindex artifact bundle"),
])
def test_bad_manifest_is_refused(bundle, edit, expected):
    path, _, _ = bundle
    _edit_manifest(path, edit)
    with pytest.raises(CorruptBundleError) as err:
        read_manifest(path)
    assert expected in err.value.problem
    with pytest.raises(CorruptBundleError):
        read_bundle(path)


def test_foreign_or_missing_folders(tmp_path):
    import zarr

    with pytest.raises(CorruptBundleError, match="No artifact bundle"):
        read_bundle(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    with pytest.raises(CorruptBundleError):
        read_bundle(tmp_path / "plain")
    zarr.open_group(str(tmp_path / "group"), mode="w", zarr_format=3)
    with pytest.raises(CorruptBundleError, match="not a dsaindex artifact bundle"):
        read_bundle(tmp_path / "group")


def test_refuses_to_overwrite(bundle):
    path, _, _ = bundle
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(DsaIndexError) as err:
        write_bundle(path, make_manifest(), make_arrays(1))
    assert "exists and is not empty" in err.value.problem and "new path" in err.value.fix
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    read_bundle(path)


def test_empty_folder_is_accepted(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    arrays = make_arrays()
    write_bundle(path, make_manifest(), arrays)
    manifest, read = read_bundle(path)
    assert sorted(read) == sorted(arrays) and sorted(manifest.layers) == sorted(str(k) for k in arrays)
    for layer, named in arrays.items():
        for name, value in named.items():
            np.testing.assert_array_equal(read[layer][name], value)


def test_crash_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import zarr

    original = zarr.Group.create_array
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", failing)
    with pytest.raises(OSError, match="disk full"):
        write_bundle(tmp_path / "bundle", make_manifest(), make_arrays())
    assert os.listdir(tmp_path) == []


def test_arrays_must_match_manifest(tmp_path):
    arrays = make_arrays()
    arrays[9] = {"x": np.zeros(3, np.float32)}
    with pytest.raises(DsaIndexError, match="layer 9"):
        write_bundle(tmp_path / "a", make_manifest(), arrays)
    with pytest.raises(DsaIndexError, match="not a plain name"):
        write_bundle(tmp_path / "b", make_manifest(), {1: {"../x": np.zeros(3, np.float32)}})
    with pytest.raises(DsaIndexError, match="numeric dtype"):
        write_bundle(tmp_path / "c", make_manifest(), {1: {"names": np.array(["a", "b"])}})
    assert os.listdir(tmp_path) == []


def test_layers_without_arrays_and_int_keys(tmp_path):
    manifest = make_manifest(metrics={})
    written = write_bundle(tmp_path / "b", manifest, {1: make_arrays()[1]})
    assert written.layers["4"].arrays == {} and written.metrics == {}
    back_manifest, back = read_bundle(tmp_path / "b")
    assert back[4] == {} and sorted(back[1]) == sorted(make_arrays()[1])


def _store(path, seed):
    settings = CaptureSettings(seq_len=16, chunk_len=16, basis="raw", key_dtype="float32")
    store = CaptureStore.create(path, new_manifest(FINGERPRINT, settings, {"sources": ["x"]}, "tok"))
    rng = np.random.default_rng(seed)
    batch = SequenceBatch(
        sequence_tokens=[16], sequence_keys=[16], sequence_queries=[2],
        tokens=[np.arange(16)], query_position=[np.array([3, 9])], query_sequence=[np.array([0, 0])],
        query_window=[np.array([-1, -1])],
        keys={layer: [rng.standard_normal((16, 8)).astype(np.float32)] for layer in (1, 4)},
        queries={layer: [rng.standard_normal((2, 3, 8)).astype(np.float32)] for layer in (1, 4)},
        head_weights={layer: [rng.standard_normal((2, 3)).astype(np.float32)] for layer in (1, 4)},
    )
    store.append(batch)
    return store


def test_store_digest_follows_content(tmp_path):
    store = _store(tmp_path / "store", 0)
    digest = store_digest(store)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert store_digest(CaptureStore.open(tmp_path / "store")) == digest
    key_chunks = chunk_files(tmp_path / "store" / "layers" / "4" / "keys")
    data = bytearray(key_chunks[0].read_bytes())
    data[-1] ^= 1
    key_chunks[0].write_bytes(bytes(data))
    assert store_digest(CaptureStore.open(tmp_path / "store")) != digest
    assert store_digest(_store(tmp_path / "other", 0)) != digest  # another store id
