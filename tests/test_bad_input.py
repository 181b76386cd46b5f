"""Bad input: a clear one-line error naming the fix, exit code 2, and nothing already captured lost."""

import hashlib
import json
import shutil

import pytest

from helpers import run_cli


def snapshot(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".writer")}


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert "Fix:" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i} " * 40}) for i in range(6)))
    store = root / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "2",
                   "--seq-len", "200", "--chunk-len", "100", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return root, corpus, store


def write_config(tmp_path, config):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_model_without_dsa_indexer(tmp_path):
    d = write_config(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64})
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", str(d), "-n", "1"), "llama", "indexer")
    assert not (tmp_path / "s").exists()


def test_dsa_family_config_without_indexer(tmp_path):
    d = write_config(tmp_path, {"model_type": "deepseek_v32", "num_hidden_layers": 2})
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", str(d)), "no indexer", "index_n_heads")


def test_unknown_family(tmp_path):
    d = write_config(tmp_path, {"model_type": "sparse_future_9", "num_hidden_layers": 2})
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", str(d)), "sparse_future_9", "families")


def test_hub_id_without_local_files(tmp_path):
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", "deepseek-ai/DeepSeek-V3.2"), "no network")


def test_unknown_preset(tmp_path):
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", "preset:huge"), "preset", "tiny-v32")


def test_resume_with_another_model_loses_nothing(small_store):
    root, corpus, store = small_store
    before = snapshot(store)
    proc = run_cli("capture", str(store), "-m", "preset:tiny-glm5", "-c", str(corpus), "-n", "4",
                   "--seq-len", "200", "--chunk-len", "100", "--no-progress")
    assert_clean_error(proc, "another model", "family")
    assert snapshot(store) == before


def test_resume_across_transformers_releases_compares_config_fields(small_store, tmp_path):
    """A store's model is compared by its config fields where the digests differ (another transformers
    release: a renamed label, a field one release lacks), by digest alone where the store records no fields
    (stores written before fields were recorded), and a differing number is named."""
    _, corpus, original = small_store

    def resume_with(edit, name):
        store = tmp_path / name
        shutil.copytree(original, store)
        meta = store / "zarr.json"
        doc = json.loads(meta.read_text())
        edit(doc["attributes"]["dsaindex"]["manifest"]["model"])
        meta.write_text(json.dumps(doc))
        before = snapshot(store)
        proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "3",
                       "--seq-len", "200", "--chunk-len", "100", "--no-progress")
        return proc, before, store

    def other_release(model):
        model["config_digest"] = "f" * 16
        model["config_fields"]["layer_types"] = ["deepseek_sparse_attention"] * len(model["config_fields"]["layer_types"])
        model["config_fields"].pop("output_router_logits", None)

    proc, _, _ = resume_with(other_release, "release")
    assert proc.returncode == 0 and "resumed after 2 committed sequences" in proc.stdout, proc.stderr
    proc, _, _ = resume_with(lambda model: model.pop("config_fields"), "before_fields")
    assert proc.returncode == 0, proc.stderr

    def digest_only(model):
        model.pop("config_fields")
        model["config_digest"] = "f" * 16

    proc, before, store = resume_with(digest_only, "digest_only")
    assert_clean_error(proc, "another model", "config_digest")
    assert snapshot(store) == before

    def other_number(model):
        other_release(model)
        model["config_fields"]["rms_norm_eps"] = 0.5

    proc, before, store = resume_with(other_number, "other_number")
    assert_clean_error(proc, "another model", "config_digest", "config_fields.rms_norm_eps: store=0.5")
    assert snapshot(store) == before


def test_resume_with_other_settings_loses_nothing(small_store):
    root, corpus, store = small_store
    before = snapshot(store)
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "4",
                   "--seq-len", "100", "--chunk-len", "100", "--no-progress")
    assert_clean_error(proc, "another settings", "seq_len")
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "4",
                   "--seq-len", "200", "--chunk-len", "100", "--basis", "raw", "--no-progress")
    assert_clean_error(proc, "basis")
    assert snapshot(store) == before


def test_store_info_json(small_store):
    _, _, store = small_store
    proc = run_cli("store", "info", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["committed"]["sequences"] == 2 and info["committed"]["keys"] == 400
    assert info["layers"] == [0, 1, 2, 3] and info["model"]["family"] == "deepseek_v32"


def test_corrupt_and_foreign_stores(small_store, tmp_path):
    _, corpus, store = small_store
    assert_clean_error(run_cli("store", "info", str(tmp_path / "nowhere")), "no capture store")

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "zarr.json").write_text("{not json")
    assert_clean_error(run_cli("store", "info", str(garbage)), "not a zarr")

    import zarr

    foreign = tmp_path / "foreign"
    zarr.open_group(str(foreign), mode="w").attrs["owner"] = "someone else"
    assert_clean_error(run_cli("store", "info", str(foreign)), "not a dsaindex capture store")
    before = snapshot(foreign)
    proc = run_cli("capture", str(foreign), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "1",
                   "--seq-len", "200", "--no-progress")
    assert_clean_error(proc, "not a dsaindex capture store")
    assert snapshot(foreign) == before

    # a zarr v2 group, even one that carries a store's attributes, is refused for its format
    v2 = tmp_path / "v2"
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]
    zarr.open_group(str(v2), mode="w", zarr_format=2).attrs.update(attrs)
    assert_clean_error(run_cli("store", "info", str(v2)), "is a zarr v2 group, not the v3 group")

    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    shutil.rmtree(damaged / "layers" / "2" / "keys")
    assert_clean_error(run_cli("store", "info", str(damaged)), "layers/2/keys")

    edited = tmp_path / "edited"
    shutil.copytree(store, edited)
    meta = json.loads((edited / "zarr.json").read_text())
    meta["attributes"]["dsaindex"]["manifest"]["settings"]["seq_len"] = "long"
    (edited / "zarr.json").write_text(json.dumps(meta))
    assert_clean_error(run_cli("store", "info", str(edited)), "invalid capture manifest", "seq_len")

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    proc = run_cli("capture", str(occupied), "-m", "preset:tiny-v32", "-c", str(corpus), "-n", "1", "--no-progress")
    assert_clean_error(proc, "not empty")
    assert (occupied / "notes.txt").read_text() == "mine"


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean_error(run_cli("capture", str(tmp_path / "s"), "-m", "preset:tiny-v32", "-c", str(empty)),
                       "no non-empty text files")
    wrong_field = tmp_path / "c.jsonl"
    wrong_field.write_text('{"body": "text under another field"}\n')
    assert_clean_error(run_cli("capture", str(tmp_path / "s2"), "-m", "preset:tiny-v32", "-c", str(wrong_field)),
                       "no sequence")
    assert not (tmp_path / "s2").exists()
    assert_clean_error(run_cli("capture", str(tmp_path / "s3"), "-m", "preset:tiny-v32", "-c",
                               str(tmp_path / "missing.txt")), "does not exist")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{oops\n')
    assert_clean_error(run_cli("capture", str(tmp_path / "s4"), "-m", "preset:tiny-v32", "-c", str(bad_json)),
                       "bad.jsonl:2")
