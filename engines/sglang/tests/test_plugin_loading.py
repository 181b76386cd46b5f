"""(a) SGLang's own plugin loader finds and runs the entry point; (b) its hook registry then says the DSA
indexer's decode selection is the plugin's; (d) startup with artifacts of another model fails with the
runtime check's message."""

from __future__ import annotations

import pytest
from bundles import pq_bundle
from conftest import run_json

LOAD = """
import json, sys
assert 'dsaindex_sglang' not in sys.modules
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
mod = sys.modules.get('dsaindex_sglang')
hooks = {t: [(ht.value, getattr(h, '__module__', ''), src.plugin_name if src else None, src.dist_name if src else None)
             for ht, h, src in v] for t, v in HookRegistry._hooks.items()}
from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
fn = Indexer._get_topk_paged
print(json.dumps({"imported": mod is not None, "registered": bool(mod and mod._registered), "hooks": hooks,
                  "patched": sorted(HookRegistry._patched), "select_module": fn.__module__,
                  "wrapped": getattr(getattr(fn, '__wrapped__', None), '__qualname__', None)}))
"""

SELECT = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged"
PREFILL = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_ragged"
CONFIG = "sglang.srt.configs.model_config.ModelConfig.__init__"
TRANSFER = "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred"


def test_sglang_loader_discovers_and_runs_the_entry_point(bench_bundle):
    got = run_json(LOAD, {"DSAINDEX_ARTIFACTS": str(bench_bundle), "SGLANG_PLUGINS": None})
    assert got["imported"] and got["registered"]
    assert got["hooks"][SELECT] == [["around", "dsaindex_sglang.hooks", "dsaindex", "dsaindex-sglang"]]
    assert got["hooks"][CONFIG] == [["after", "dsaindex_sglang.hooks", "dsaindex", "dsaindex-sglang"]]
    assert SELECT in got["patched"] and CONFIG in got["patched"]
    assert got["wrapped"] == "Indexer._get_topk_paged"  # the original sits under the plugin's wrapper


def test_sglang_plugins_whitelist_and_unset_artifacts_leave_sglang_alone(bench_bundle):
    other = run_json(LOAD, {"DSAINDEX_ARTIFACTS": str(bench_bundle), "SGLANG_PLUGINS": "someone_else"})
    assert not other["imported"] and SELECT not in other["hooks"]
    unset = run_json(LOAD, {"DSAINDEX_ARTIFACTS": None, "SGLANG_PLUGINS": "dsaindex"})
    assert unset["imported"] and not unset["registered"]  # the loader ran register(); it did nothing
    assert SELECT not in unset["hooks"] and unset["wrapped"] is None


def test_registry_says_the_selection_is_the_plugins(plugin):
    import dsaindex_sglang.hooks as hooks
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    entries = HookRegistry._hooks[SELECT]
    assert [(ht, h) for ht, h, _ in entries] == [(HookType.AROUND, hooks.select_around_get_topk_paged)]
    assert entries[0][2].plugin_name == "dsaindex" and entries[0][2].dist_name == "dsaindex-sglang"
    assert SELECT in HookRegistry._patched
    assert Indexer._get_topk_paged.__wrapped__.__qualname__ == "Indexer._get_topk_paged"
    # the eager prefill top-k is followed by the encoding of the prompt's pages
    prefill = HookRegistry._hooks[PREFILL]
    assert [(ht, h) for ht, h, _ in prefill] == [(HookType.AFTER, hooks.encode_after_get_topk_ragged)]
    assert PREFILL in HookRegistry._patched
    # a PD decode node's arriving transfers are followed by the encoding of their pages
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    transfer = HookRegistry._hooks[TRANSFER]
    assert [(ht, h) for ht, h, _ in transfer] == [(HookType.AFTER, hooks.encode_after_pop_transferred)]
    assert TRANSFER in HookRegistry._patched
    assert DecodeTransferQueue.pop_transferred.__wrapped__.__qualname__ == "DecodeTransferQueue.pop_transferred"
    # the ModelConfig hook ran: artifacts validated and one PQ selector per indexer layer
    assert sorted(plugin["state"].selectors) == [0, 1, 2, 3]
    assert plugin["state"].loaded.manifest.model.name == "preset:bench-v32"


STARTUP = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.model_config import ModelConfig
try:
    ModelConfig(MODEL_PATH)
    print(json.dumps({"ok": True}))
except Exception as err:
    print(json.dumps({"ok": False, "type": type(err).__name__, "message": str(err)}))
"""


def expected_message(bundle, model_path) -> str:
    from transformers import AutoConfig

    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.compat import check_bundle_for_model
    from dsaindex.errors import ArtifactMismatchError

    with pytest.raises(ArtifactMismatchError) as err:
        check_bundle_for_model(read_manifest(bundle), AutoConfig.from_pretrained(model_path))
    return str(err.value)


@pytest.mark.parametrize("case", ["other geometry", "same geometry, other model"])
def test_startup_with_artifacts_of_another_model_fails_with_the_mismatch_message(tmp_path, bench_dir, case):
    if case == "other geometry":
        pq_bundle(tmp_path / "b", "tiny-v32")  # 8 indexer heads; the served model has 64
        needle = "indexer heads"
    else:
        from dsaindex.pipelines.capture.presets import preset_config

        other = preset_config("bench-v32")
        other.max_position_embeddings = 4096
        pq_bundle(tmp_path / "b", "bench-v32", config=other)
        needle = "were trained for"
    want = expected_message(tmp_path / "b", bench_dir)
    assert needle in want and "Fix:" in want
    got = run_json(STARTUP.replace("MODEL_PATH", repr(str(bench_dir))), {"DSAINDEX_ARTIFACTS": str(tmp_path / "b")})
    assert got == {"ok": False, "type": "ArtifactMismatchError", "message": want}


def test_startup_with_the_models_own_artifacts_passes(bench_bundle, bench_dir):
    got = run_json(STARTUP.replace("MODEL_PATH", repr(str(bench_dir))), {"DSAINDEX_ARTIFACTS": str(bench_bundle)})
    assert got == {"ok": True}


STARTUP_C = STARTUP.replace('print(json.dumps({"ok": True}))', """import dsaindex_sglang.hooks as hooks
    print(json.dumps({"ok": True, "c": {str(k): v.candidates for k, v in hooks.STATE.selectors.items()}}))""")


def test_auto_candidates_take_each_layers_c_from_the_bundles_recall(tmp_path, bench_dir):
    """DSAINDEX_CANDIDATES=auto: each layer's selector gets the smallest C whose recorded held-out recall
    reaches DSAINDEX_RECALL_TARGET; startup fails naming the layer when none does."""
    metrics = {}
    for layer in range(4):
        low = layer == 0
        metrics.update({f"layer{layer}/k2048/rerank@4096": 0.99 if low else 0.999,
                        f"layer{layer}/k2048/rerank@8192": 0.997 if low else 1.0})
    pq_bundle(tmp_path / "b", "bench-v32", metrics=metrics)
    env = {"DSAINDEX_ARTIFACTS": str(tmp_path / "b"), "DSAINDEX_CANDIDATES": "auto"}
    script = STARTUP_C.replace("MODEL_PATH", repr(str(bench_dir)))
    assert run_json(script, env) == {"ok": True, "c": {"0": 8192, "1": 4096, "2": 4096, "3": 4096}}
    strict = run_json(script, env | {"DSAINDEX_RECALL_TARGET": "0.999"})
    assert strict["ok"] is False and strict["type"] == "DsaIndexError"
    assert "Layer 0 of" in strict["message"] and "99.70%" in strict["message"] and "Fix:" in strict["message"]


STARTUP_GROW = STARTUP.replace('print(json.dumps({"ok": True}))', """import dsaindex_sglang.hooks as hooks
    print(json.dumps({"ok": True, "band": {str(k): v.grow_band for k, v in hooks.STATE.selectors.items()}}))""")


def test_c_grows_past_the_prefix_band_each_layers_recall_was_measured_in_unless_told_to_stay(tmp_path, bench_dir):
    """DSAINDEX_LONG_PREFIX (default ``grow``): each layer's selector grows C past the end of the longest prefix
    band its bundle records the served recall in (0 where it records none); ``fixed`` keeps C."""
    metrics = {}
    for layer in range(4):
        metrics.update({f"layer{layer}/k2048/prefilter4@4096": 0.998})
        if layer != 3:  # layer 3: no band recorded
            metrics.update({f"layer{layer}/k2048@64K-128K/prefilter4@4096": 0.996,
                            f"layer{layer}/k2048@64K-128K/queries": 20})
    pq_bundle(tmp_path / "b", "bench-v32", metrics=metrics)
    env = {"DSAINDEX_ARTIFACTS": str(tmp_path / "b")}
    script = STARTUP_GROW.replace("MODEL_PATH", repr(str(bench_dir)))
    assert run_json(script, env) == {"ok": True, "band": {"0": 131072, "1": 131072, "2": 131072, "3": 0}}
    assert run_json(script, env | {"DSAINDEX_LONG_PREFIX": "fixed"}) == {"ok": True, "band": dict.fromkeys("0123", 0)}
