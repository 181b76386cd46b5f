"""The memory and admission planner (leansparse §4, Eq. 1-5) and ``dsaindex plan memory``."""

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from dsaindex.errors import DsaIndexError, UnsupportedModelError
from dsaindex.pipelines.commands.plan import plan_app
from dsaindex.runtime.planner import (
    INDEX_MODES,
    MODEL_SHAPES,
    Machine,
    admission,
    break_even_chunk,
    compute_time,
    engine_pool,
    load_time,
    model_from_config,
    parameter_count,
    prefix_payload_bytes,
    prefix_state_peak,
    wait_time,
)

V32 = MODEL_SHAPES["deepseek-v3.2"]
MILLION = 1 << 20
PREFIX = MILLION - 4096  # the last 4K chunk of a 1M-token prefill


@pytest.mark.parametrize("kv_offloaded", [False, True])
@pytest.mark.parametrize("prefix", [262_144 - 4096, PREFIX])
def test_wait_is_zero_from_the_break_even_chunk_and_positive_below(kv_offloaded, prefix):
    machine, eta = Machine(), 0.6
    chunk = break_even_chunk(V32, machine, prefix, eta, kv_offloaded)
    assert chunk is not None and chunk % 64 == 0 and chunk > 64, chunk
    for c in (chunk, chunk + 64, 2 * chunk, 8 * chunk):
        assert wait_time(V32, machine, c, prefix, eta, kv_offloaded) == 0.0, c
        assert compute_time(V32, machine, c, prefix, eta) >= load_time(V32, machine, c, prefix, kv_offloaded)
    for c in (chunk - 64, chunk // 2, 64):
        assert wait_time(V32, machine, c, prefix, eta, kv_offloaded) > 0.0, c


def test_a_short_prefix_is_hidden_by_the_smallest_chunk():
    # reading the layer's weights alone outlasts loading 20K keys
    assert break_even_chunk(V32, Machine(), 20_000, 0.6, False) == 64
    assert wait_time(V32, Machine(), 64, 20_000, 0.6, False) == 0.0


def test_no_break_even_when_the_link_is_too_slow():
    assert break_even_chunk(V32, Machine(host_bps=1e3), PREFIX, 0.6, True, max_chunk=1 << 14) is None


@pytest.mark.parametrize("kv_offloaded", [False, True])
def test_load_time_is_linear_in_the_prefix(kv_offloaded):
    machine = Machine(delay_s=3e-4)
    loads = [load_time(V32, machine, 4096, n * 100_000, kv_offloaded) for n in range(5)]
    steps = np.diff(loads)
    per_token = V32.index_key_bytes + (V32.kv_bytes if kv_offloaded else 0)
    np.testing.assert_allclose(steps, 100_000 * per_token / machine.host_bps, rtol=1e-12)
    payload = prefix_payload_bytes(V32, PREFIX, kv_offloaded)
    assert prefix_payload_bytes(V32, 2 * PREFIX, kv_offloaded) == 2 * payload


@pytest.mark.parametrize("kv_offloaded", [False, True])
def test_break_even_chunk_falls_as_host_bandwidth_rises(kv_offloaded):
    chunks = [break_even_chunk(V32, Machine(host_bps=gbps * 1e9), PREFIX, 0.6, kv_offloaded)
              for gbps in (12.5, 25, 50, 100)]
    assert all(a > b for a, b in zip(chunks, chunks[1:], strict=False)), chunks


@pytest.mark.parametrize("kv_offloaded", [False, True])
def test_streaming_holds_two_layers_and_residency_all(kv_offloaded):
    payload = prefix_payload_bytes(V32, PREFIX, kv_offloaded)
    peak = prefix_state_peak(V32, PREFIX, kv_offloaded)
    assert peak["streaming"] == 2 * payload
    assert peak["resident"] == V32.num_layers * payload
    assert payload == PREFIX * (132 + (656 if kv_offloaded else 0))


def test_pq_codes_admit_more_requests_at_one_million_tokens():
    machine = Machine()
    counts = {(mode, kv): admission(V32, machine, MILLION, code, kv, 4096)["requests"]
              for mode, code in INDEX_MODES.items() for kv in (False, True)}
    assert counts["pq16", True] > counts["pq32", True] > counts["exact", True] > 0, counts
    assert counts["pq16", False] >= counts["pq32", False] >= counts["exact", False], counts
    bigger = replace(machine, hbm_bytes=2 * machine.hbm_bytes)
    assert admission(V32, bigger, MILLION, 32, True, 4096)["requests"] > counts["pq32", True]


def test_ivf_prefill_trades_the_logits_scratch_for_its_index_state():
    """With the runtime's IVF prefill the chunk's scratch is its candidates, not logits over every key, and
    the request's IVF state (per key in every indexer layer, plus one layer's dequantized prefix) is
    reserved instead: at 1M tokens that admits more requests than exact prefill scoring."""
    from dsaindex.runtime.planner import (
        CANDIDATE_BYTES,
        FLOAT_KEY_BYTES,
        IVF_STATE_BYTES,
        prefill_reservation,
    )

    machine = Machine()
    exact = prefill_reservation(V32, machine, 4096, PREFIX, 32, True)
    ivf = prefill_reservation(V32, machine, 4096, PREFIX, 32, True, ivf_budget=16384)
    assert exact["W_ivf"] == 0 and exact["W_scratch"] == 4096 * MILLION * 4
    assert ivf["W_scratch"] == 4096 * 16384 * CANDIDATE_BYTES
    assert ivf["W_ivf"] == pytest.approx(MILLION * (IVF_STATE_BYTES * V32.indexer_layers + FLOAT_KEY_BYTES * 128))
    assert ivf["W_p"] - exact["W_p"] == pytest.approx(ivf["W_scratch"] + ivf["W_ivf"] - exact["W_scratch"])
    assert ivf["W_p"] < exact["W_p"]
    with_ivf = admission(V32, machine, MILLION, 32, True, 4096, ivf_budget=16384)["requests"]
    assert with_ivf > admission(V32, machine, MILLION, 32, True, 4096)["requests"]
    # a budget above the prefix scores every key: no more scratch than that
    tiny = prefill_reservation(V32, machine, 64, 0, 32, True, ivf_budget=16384)
    assert tiny["W_scratch"] == 64 * 64 * CANDIDATE_BYTES


def test_parameter_counts_match_the_published_sizes():
    # 671B: V3's main model (V3.2 adds a 0.85B indexer; the 14B MTP module is not counted)
    assert abs(parameter_count(V32) / 671e9 - 1) < 0.05, parameter_count(V32)
    assert abs(parameter_count(MODEL_SHAPES["glm-5"]) / 744e9 - 1) < 0.05, parameter_count(MODEL_SHAPES["glm-5"])


def test_presets_are_the_transformers_defaults():
    import transformers

    for name, cls in (("deepseek-v3.2", transformers.DeepseekV32Config),
                      ("glm-5", transformers.GlmMoeDsaConfig)):
        assert model_from_config(cls().to_dict(), name=name) == MODEL_SHAPES[name]


def test_config_without_an_indexer_or_of_another_family_is_refused():
    with pytest.raises(UnsupportedModelError, match="llama"):
        model_from_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(UnsupportedModelError, match="no indexer"):
        model_from_config({"model_type": "deepseek_v32", "num_hidden_layers": 2, "index_n_heads": 0})


# ---- the command ---------------------------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(plan_app, ["memory", *args])


def test_cli_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "plan.json", tmp_path / "plan.md"
    result = invoke("--out", str(out), "--markdown", str(md), "--contexts", "65536,1048576")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"model", "machine", "context", "chunk", "prefix", "efficiency", "streaming",
            "prefill_reservation", "budget", "admission"} <= set(report)
    assert report["prefix"] == PREFIX
    for payload in ("index_keys", "index_keys+mla_kv"):
        assert {"load_bytes", "load_s", "compute_s", "wait_s", "break_even_chunk", "peak_bytes"} <= set(
            report["streaming"][payload])
    rows = report["admission"]["rows"]
    assert [r["context"] for r in rows] == [65536, MILLION]
    assert set(rows[0]["requests"]) == {f"{m}/{kv}" for m in ("exact", "pq32", "pq16")
                                        for kv in ("resident", "offloaded")}
    assert "pq16 offloaded" in md.read_text() and "break-even" in result.output
    ivf = invoke("--json", "--contexts", "1048576", "--ivf-budget", "16384")
    assert ivf.exit_code == 0, ivf.output
    with_ivf = json.loads(ivf.output)
    assert with_ivf["admission"]["prefill"] == "ivf, 16384 candidates"
    assert with_ivf["prefill_reservation"]["pq32/offloaded"]["W_ivf"] > 0
    assert with_ivf["admission"]["rows"][0]["requests"]["pq32/offloaded"] >= rows[1]["requests"]["pq32/offloaded"]


def test_cli_reads_a_config_and_a_bundle(tmp_path):
    from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
    from dsaindex.artifacts.fingerprint import ModelFingerprint
    from dsaindex.geometry import IndexerGeometry

    config = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "index_n_heads": 64,
              "index_head_dim": 128, "index_topk": 2048}  # the rest: transformers' defaults
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    geometry = IndexerGeometry(family="deepseek_v32", num_layers=2, indexer_layers=(0, 1), n_heads=4,
                               head_dim=128, topk=16, rope_dim=64, rope_layout="half_split_head")
    fingerprint = ModelFingerprint(name="t", family="deepseek_v32", geometry=geometry, config_digest="c0",
                                   weights_digest="w0", dtype="bfloat16")
    lineage = Lineage(capture_store_id="s", capture_store_path="/s", capture_store_digest="d",
                      train_sequences=[0], eval_sequences=[1])
    pq = {"subspaces": 16, "centroids": 16}  # 4-bit codes: 8 bytes per key
    layers = {i: LayerArtifact(kind="pq", params=pq) for i in (0, 1)}
    codebooks = np.zeros((16, 16, 8), np.float32)
    manifest = new_bundle_manifest(fingerprint, "hadamard", "fp8_e4m3_ue8m0", layers, lineage)
    write_bundle(tmp_path / "b", manifest, {0: {"codebooks": codebooks}, 1: {"codebooks": codebooks}})
    result = invoke("--model", str(tmp_path / "ckpt"), "--artifacts", str(tmp_path / "b"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["admission"]["code_bytes"]["artifacts"] == 8
    last = report["admission"]["rows"][-1]["requests"]
    assert last["artifacts/offloaded"] > last["pq16/offloaded"]
    preset = json.loads(invoke("--json").output)
    assert report["streaming"] == preset["streaming"]  # a config of V3.2 plans as the preset does


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "no-such-model"),
    (["--efficiency", "1.5"], "--efficiency"),
    (["--chunk", "8192", "--context", "4096"], "--chunk"),
    (["--contexts", "many"], "--contexts"),
    (["--code-bytes", "8", "--artifacts", "x"], "--artifacts"),
    (["--mode", "engine"], "--mode"),
])
def test_cli_names_the_problem(args, needle):
    result = invoke(*args)
    assert isinstance(result.exception, DsaIndexError), result.output
    assert needle in result.exception.problem and result.exception.fix


def test_cli_refuses_a_config_of_another_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama"}))
    assert isinstance(invoke("--model", str(path)).exception, UnsupportedModelError)
    path.write_text("{not json")
    result = invoke("--model", str(path))
    assert isinstance(result.exception, DsaIndexError) and "JSON" in result.exception.problem


@pytest.mark.parametrize("kv_dtype, kv_per_layer", [("fp8", 656), ("bf16", 1152)])
def test_engine_pool_with_host_keys_admits_more_tokens(kv_dtype, kv_per_layer):
    """Per token, the engine's pool holds 61 layers of MLA KV and 61 layers of 132-byte index keys; the
    plugin adds its codes beside the keys (keys on the GPU) or holds only the codes (keys on the host)."""
    m = replace(V32, kv_dtype=kv_dtype)
    code = 32 + 33 / 64
    pool = engine_pool(m, Machine(), [131072, MILLION], code)
    per_token = pool["bytes_per_token"]
    assert per_token["engine"] == 61 * kv_per_layer + 61 * 132
    assert per_token["plugin_device"] == pytest.approx(per_token["engine"] + 61 * code)
    assert per_token["plugin_host"] == pytest.approx(61 * kv_per_layer + 61 * code)
    tokens = pool["tokens"]
    assert tokens["plugin_host"] > tokens["engine"] > tokens["plugin_device"]
    assert tokens["engine"] == int(pool["budget_bytes"] // per_token["engine"])
    # the index's GPU bytes per token with host keys: at most a third of the exact keys'
    assert pool["index_bytes_per_token"]["plugin_host"] <= pool["index_bytes_per_token"]["engine"] / 3
    first = pool["requests"][0]
    assert first["context"] == 131072 and first["plugin_host"] == tokens["plugin_host"] // 131072
    assert pool["gain"]["plugin_host"] == pytest.approx(tokens["plugin_host"] / tokens["engine"] - 1)


def test_cli_plugin_mode(tmp_path):
    md = tmp_path / "plugin.md"
    result = invoke("--mode", "plugin", "--contexts", "131072", "--markdown", str(md))
    assert result.exit_code == 0, result.output
    assert "tokens per GPU" in result.output and "keys on host" in result.output
    report = json.loads(invoke("--mode", "plugin", "--contexts", "131072", "--json").output)
    assert report["mode"] == "plugin" and report["code_bytes"] == pytest.approx(32 + 33 / 64)
    assert report["tokens"]["plugin_host"] > report["tokens"]["engine"]
    assert "requests of 131,072 tokens" in md.read_text()
    pq16 = json.loads(invoke("--mode", "plugin", "--contexts", "131072", "--code-bytes", "16", "--json").output)
    assert pq16["code_bytes"] == pytest.approx(16 + 33 / 64)
    assert pq16["tokens"]["plugin_host"] > report["tokens"]["plugin_host"]
