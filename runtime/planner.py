"""Memory and admission planner for serving DSA models with layer-wise streamed prefill (leansparse §4).

The model of the paper, in its own terms (Eq. 1-5):

* prefill reservation ``W_p = 2 (I_cap + V_cap) + R_s + W_act + W_scratch`` (Eq. 1);
* prefix payload of one layer ``D_hist = L / r * (s_I + s_V)`` (Eq. 2);
* load time ``T_load = delta + (D_hist + D_new) / beta`` (Eq. 3);
* compute time ``T_comp(eta) = sum_g max(F_g / (eta P_g), Q_g / gamma)`` over a layer's op groups (Eq. 4);
* wait for the next layer's buffer ``T_wait = max(0, T_load - T_comp)`` (Eq. 5).

Units everywhere: bytes, seconds, FLOP, FLOP/s, bytes/s, tokens. Every figure is for one GPU.

Placement: one model instance spans ``Machine.gpus`` GPUs with tensor parallelism. Weights, attention
heads and the MoE FFN split evenly over them; the lightning indexer runs whole on every GPU (engines build
its projections as replicated linears); the prefix state (one MLA latent vector and one index key per
token and layer, shared by all heads) is replicated, so every GPU holds it, and loads it over its own host
link. Hence a GPU's request count is the instance's. Selection, routing, normalization, launch and
collective costs are left out, as in the paper. V3.2 and GLM-5 run DSA in every layer, so the overlap
window for layer l+1's load is the work of layer l (one MoE layer, the steady state).

This module is pure Python and imports nothing heavy, so a scheduler can call it per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from dsaindex.errors import DsaIndexError

# ---- numbers from elsewhere -------------------------------------------------------------------------
H200_HBM_BYTES = 141e9  # H200 spec sheet, "141 GB" HBM3e (torch reports 150.1e9 B = 139.8 GiB on the device)
USABLE_HBM_FRACTION = 0.9  # what a server gives weights and state (vLLM's gpu_memory_utilization default);
# the rest is the CUDA context, communication buffers and graphs
H200_HBM_READ_BPS = 3.77e12  # gamma: HBM read rate measured on the H200 (bench decode's floors; DESIGN.md:
# device copy 4.2-4.3 TB/s)
H200_BF16_FLOPS = 790e12  # dense bf16 GEMM measured on the H200 (8192^3: 784 TFLOP/s; spec sheet 989)
H200_FP8_FLOPS = 1.58e15  # dense FP8: twice the measured bf16 rate, as FP8 tensor cores run at twice bf16
# (spec sheet 1.979e15; an 8192^3 torch._scaled_mm measured 1.43e15)
PCIE5_HOST_BPS = 50e9  # beta: pinned host-to-device per GPU over PCIe gen5 x16 (64 GB/s raw, ~55 GB/s
# measured alone on one H200); lower when GPUs share a host link: measure it under load, pass --host-gbps
LOAD_DELAY_S = 0.0  # delta: buffer-reuse and startup delay; leansparse Fig. 8 models delta = 0
DEFAULT_EFFICIENCY = 0.6  # eta: DESIGN.md measures DeepGEMM's prefill logits at 0.9-1.0 PFLOP/s on the H200,
# about 0.6 of the FP8 ceiling
DEFAULT_GPUS = 8  # V3.2's FP8 weights (~672 GB) need 8 H200s: the one-node deployment

FP8_SCALE_BYTES = 4  # one ue8m0 scale per FP8 index key, stored as 4 bytes (DESIGN.md: 128 + 4 = 132 B/key)
FLASHMLA_FP8_TILE = 128  # FlashMLA's FP8 KV: a 4-byte scale per 128 latent dims, RoPE dims kept in bf16
LOGIT_BYTES = 4  # the prefill indexer writes fp32 logits [queries, keys] (DeepGEMM fp8_mqa_logits)
WEIGHT_SCALE_BLOCK = 128 * 128  # DeepSeek FP8 checkpoints: one 4-byte scale per 128 x 128 weight block
DECODE_CACHE_ROWS = 4096  # exact keys cached per request and layer by PQ decode (bench decode --cache)
TAIL_ROWS = 64  # DESIGN.md: completed 64-token pages are encoded, so at most one page of exact tail keys
MAX_CHUNK = 1 << 20  # the break-even search stops here

# the runtime's IVF prefill (serving's IVFPrefillIndexer with streamed keys): per key and indexer layer, what
# stays on the GPU while the request prefills, CausalIVF.device_bytes() at window 1024, clusters of 128,
# 4,096-token chunks (docs/results.md, "Streamed IVF keys"): the FP8 scale (4 B) and the cluster versions
# (18.1 B); the keys stream, the refit bounds wait on the host
IVF_STATE_BYTES = 22.1
CANDIDATE_BYTES = 4 + 4  # per IVF candidate of a query: its int32 position and its fp32 exact score
FLOAT_KEY_BYTES = 4  # the dequantized float32 view of one layer's prefix while that layer selects

# index mode -> bytes per key and layer resident on the GPU (None: exact FP8 keys, all resident)
INDEX_MODES: dict[str, float | None] = {"exact": None, "pq32": 32, "pq16": 16}
KV_MODES = ("resident", "offloaded")


def mla_kv_bytes(kv_lora_rank: int, rope_dim: int, dtype: str) -> int:
    """Bytes of one token's MLA cache entry in one layer: ``fp8`` is FlashMLA's layout (latent in FP8
    with a 4-byte scale per 128 dims, RoPE part in bf16: 512 + 16 + 128 = 656 B on V3.2), ``bf16`` is
    2 bytes per dim (1152 B on V3.2)."""
    if dtype == "bf16":
        return 2 * (kv_lora_rank + rope_dim)
    if dtype == "fp8":
        return kv_lora_rank + FP8_SCALE_BYTES * math.ceil(kv_lora_rank / FLASHMLA_FP8_TILE) + 2 * rope_dim
    raise DsaIndexError(f"MLA KV dtype {dtype!r} is not one this planner knows.", "use fp8 or bf16.")


@dataclass(frozen=True)
class Machine:
    """One GPU of a serving node, and how many of them hold one model instance.

    hbm_bytes : device memory (bytes); ``usable_fraction`` of it is for weights and state.
    hbm_bps : gamma of Eq. 4, HBM bandwidth (bytes/s).
    bf16_flops, fp8_flops : dense compute ceilings P_g (FLOP/s).
    host_bps : beta of Eq. 3, effective host-to-device bandwidth per GPU under concurrent traffic
        (bytes/s). The default is a guess for PCIe gen5: measure it on the serving node.
    delay_s : delta of Eq. 3, buffer-reuse and startup delay (s).
    gpus : GPUs one model instance spans (tensor parallel degree).
    """

    name: str = "h200"
    hbm_bytes: float = H200_HBM_BYTES
    usable_fraction: float = USABLE_HBM_FRACTION
    hbm_bps: float = H200_HBM_READ_BPS
    bf16_flops: float = H200_BF16_FLOPS
    fp8_flops: float = H200_FP8_FLOPS
    host_bps: float = PCIE5_HOST_BPS
    delay_s: float = LOAD_DELAY_S
    gpus: int = DEFAULT_GPUS

    def ceiling(self, precision: str) -> float:
        """P_g of Eq. 4 for ``fp8`` or ``bf16`` work (FLOP/s)."""
        return self.fp8_flops if precision == "fp8" else self.bf16_flops


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs of a DSA model with MLA attention and an MoE FFN (V3.2, GLM-5).

    Names follow the transformers configs. ``q_lora_rank`` 0 means no query compression.
    ``indexer_layers`` counts the layers that run, and keep keys for, their own indexer (GLM-5 "shared"
    layers reuse another layer's top-k). ``dense_layers`` lead with a dense FFN of
    ``dense_intermediate_size``; the rest route each token to ``experts_per_token`` of
    ``n_routed_experts`` plus ``n_shared_experts``. ``kv_dtype`` is the MLA cache format (``fp8``,
    ``bf16``); ``key_stride`` is r of Eq. 2, tokens per stored entry (1 for V3.2 and GLM-5).
    """

    name: str
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_layers: int
    n_routed_experts: int
    n_shared_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    dense_layers: int
    dense_intermediate_size: int
    kv_dtype: str = "fp8"
    key_stride: int = 1

    @property
    def index_key_bytes(self) -> int:
        """s_I: one exact index key in one layer, FP8 dims + scale (132 B at 128 dims)."""
        return self.index_head_dim + FP8_SCALE_BYTES

    @property
    def kv_bytes(self) -> int:
        """s_V: one token's MLA cache entry in one layer, in ``kv_dtype``."""
        return mla_kv_bytes(self.kv_lora_rank, self.qk_rope_head_dim, self.kv_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "index_key_bytes": self.index_key_bytes, "kv_bytes": self.kv_bytes,
                "parameters": parameter_count(self), "weight_bytes": weight_bytes(self)}


# The transformers config defaults of DeepseekV32Config (deepseek-ai/DeepSeek-V3.2) and GlmMoeDsaConfig
# (zai-org/GLM-5), which are those checkpoints' published dimensions.
MODEL_SHAPES: dict[str, ModelDims] = {
    "deepseek-v3.2": ModelDims(
        name="deepseek-v3.2", family="deepseek_v32", num_layers=61, hidden_size=7168, vocab_size=129280,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
        indexer_layers=61, n_routed_experts=256, n_shared_experts=1, experts_per_token=8,
        moe_intermediate_size=2048, dense_layers=3, dense_intermediate_size=18432),
    "glm-5": ModelDims(
        name="glm-5", family="glm_moe_dsa", num_layers=78, hidden_size=6144, vocab_size=154880,
        num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        indexer_layers=78, n_routed_experts=256, n_shared_experts=1, experts_per_token=8,
        moe_intermediate_size=2048, dense_layers=3, dense_intermediate_size=12288),
}
_FAMILY_PRESET = {"deepseek_v32": "deepseek-v3.2", "glm_moe_dsa": "glm-5"}
# ModelDims field -> transformers config key (the indexer's come through dsaindex.geometry)
_CONFIG_KEYS = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "vocab_size": "vocab_size",
    "num_attention_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "experts_per_token": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
    "dense_layers": "first_k_dense_replace", "dense_intermediate_size": "intermediate_size",
}


def model_from_config(config: Mapping[str, Any], name: str = "config", kv_dtype: str = "fp8") -> ModelDims:
    """:class:`ModelDims` from a DSA model's ``config.json`` dict (DeepseekV32 / GlmMoeDsa keys).

    A key the dict lacks (or sets to null) takes its transformers default, the family's preset value, as
    transformers does; ``q_lora_rank`` null means no query compression. Raises :class:`DsaIndexError`
    for a model without an indexer or of a family without MLA + MoE.
    """
    from dsaindex.geometry import geometry_from_config

    family = config.get("model_type")
    if family not in _FAMILY_PRESET:
        geometry_from_config(dict(config))  # names a family without an indexer, or a config without one
        raise DsaIndexError(
            f"The planner models MLA attention with an MoE FFN; {family} has another layout.",
            f"use a config of one of the families {', '.join(_FAMILY_PRESET)}, or a preset: "
            f"{', '.join(MODEL_SHAPES)}.")
    base = MODEL_SHAPES[_FAMILY_PRESET[family]]
    full = {key: getattr(base, field) for field, key in _CONFIG_KEYS.items()}
    full.update({k: v for k, v in config.items() if v is not None or k == "q_lora_rank"})
    indexer = geometry_from_config(full)  # refuses a config without an indexer
    dims = {field: int(full[key] or 0) for field, key in _CONFIG_KEYS.items()}
    if full.get("mlp_layer_types"):
        dims["dense_layers"] = sum(1 for t in full["mlp_layer_types"] if t == "dense")
    dims["dense_layers"] = min(dims["dense_layers"], dims["num_layers"])
    return ModelDims(name=name, family=family, **dims, indexer_layers=len(indexer.indexer_layers),
                     kv_dtype=kv_dtype, key_stride=indexer.key_stride)


# ---- weights ------------------------------------------------------------------------------------------
def _parameters(m: ModelDims) -> tuple[float, float]:
    """(FP8 matrix parameters, bf16 parameters) of the main model, without the multi-token-prediction
    module (the published 671B of V3 counts the same; its 14B MTP layer is loaded only for speculation)."""
    h, H = m.hidden_size, m.num_attention_heads
    q = (h * m.q_lora_rank + m.q_lora_rank * H * (m.qk_nope_head_dim + m.qk_rope_head_dim) if m.q_lora_rank
         else h * H * (m.qk_nope_head_dim + m.qk_rope_head_dim))
    attention = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                 + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + H * m.v_head_dim * h)
    indexer_fp8 = (m.q_lora_rank or h) * m.index_n_heads * m.index_head_dim + h * m.index_head_dim
    indexer_bf16 = h * m.index_n_heads + 2 * m.index_head_dim  # weights_proj, key LayerNorm
    norms = 2 * h + m.q_lora_rank + m.kv_lora_rank
    moe_layers = m.num_layers - m.dense_layers
    ffn = (m.dense_layers * 3 * h * m.dense_intermediate_size
           + moe_layers * (m.n_routed_experts + m.n_shared_experts) * 3 * h * m.moe_intermediate_size)
    router = moe_layers * (m.n_routed_experts * h + m.n_routed_experts)  # gate + score-correction bias
    fp8 = m.num_layers * attention + m.indexer_layers * indexer_fp8 + ffn
    bf16 = m.indexer_layers * indexer_bf16 + m.num_layers * norms + router + 2 * m.vocab_size * h + h
    return float(fp8), float(bf16)


def parameter_count(m: ModelDims) -> int:
    """Parameters of the main model (embeddings and LM head untied, no MTP module)."""
    return int(sum(_parameters(m)))


def weight_bytes(m: ModelDims) -> float:
    """Bytes of the model's weights in the FP8 checkpoint layout: matrices in FP8 with a 4-byte scale per
    128 x 128 block; embeddings, LM head, norms and routers in bf16."""
    fp8, bf16 = _parameters(m)
    return fp8 * (1 + 4 / WEIGHT_SCALE_BLOCK) + 2 * bf16


# ---- Eq. 4: one layer's work on one chunk ---------------------------------------------------------------
@dataclass(frozen=True)
class OpGroup:
    """A serial group of operations of Eq. 4 on one GPU: ``flops`` (FLOP), ``hbm_bytes`` (bytes read
    and written), ``precision`` picks its compute ceiling."""

    name: str
    flops: float
    hbm_bytes: float
    precision: str

    def time_s(self, machine: Machine, efficiency: float) -> float:
        """Roofline time (s): ``max(F / (eta P), Q / gamma)``."""
        compute = self.flops / (efficiency * machine.ceiling(self.precision))
        return max(compute, self.hbm_bytes / machine.hbm_bps)


def _gemm(tokens: float, k: float, n: float, shards: int = 1,
          weight_bytes_per: float = 1.0) -> tuple[float, float]:
    """(FLOP, HBM bytes) of ``x[tokens, k] @ W[k, n]`` on one of ``shards`` GPUs that split W: the weight
    read once, bf16 activations in and out (split too: a small term either way)."""
    return 2 * tokens * k * n / shards, (k * n * weight_bytes_per + 2 * tokens * (k + n)) / shards


def _sum(*parts: tuple[float, float]) -> tuple[float, float]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def experts_touched(m: ModelDims, tokens: int) -> float:
    """Expected routed experts a chunk of ``tokens`` activates in one layer, under uniform routing."""
    return m.n_routed_experts * (1 - (1 - m.experts_per_token / m.n_routed_experts) ** tokens)


def layer_op_groups(m: ModelDims, machine: Machine, chunk: int, prefix: int) -> list[OpGroup]:
    """Eq. 4's op groups for one MoE DSA layer on one GPU: a chunk of ``chunk`` new tokens on a prefix of
    ``prefix`` tokens. Weights are read once per chunk; KV and keys are read once (ideal reuse, as in the
    paper). The indexer scores all ``prefix + chunk`` keys for every query (the rectangle its logits
    kernel writes) and runs whole on each GPU; attention heads and experts split over ``machine.gpus``."""
    g, C, h, H = machine.gpus, chunk, m.hidden_size, m.num_attention_heads
    keys = (prefix + chunk) / m.key_stride
    rope, lat, nope = m.qk_rope_head_dim, m.kv_lora_rank, m.qk_nope_head_dim
    q_in = m.q_lora_rank or h
    projections = _sum(
        _gemm(C, h, m.q_lora_rank) if m.q_lora_rank else (0.0, 0.0),  # replicated down-projections
        _gemm(C, h, lat + rope),
        _gemm(C, q_in, H * (nope + rope), g),
        _gemm(C, H * m.v_head_dim, h, g),
    )
    ih, idim = m.index_n_heads, m.index_head_dim
    indexer = _sum(
        _gemm(C, q_in, ih * idim), _gemm(C, h, idim), _gemm(C, h, ih, weight_bytes_per=2),
        (2 * C * keys * ih * idim, keys * m.index_key_bytes + C * ih * idim + C * keys * LOGIT_BYTES),
    )
    selected = min(m.index_topk, keys)
    attention = _sum(
        _gemm(C, H * nope, lat, g, weight_bytes_per=2),  # absorb W_UK into the queries
        (2 * C * H / g * selected * (2 * lat + rope),  # scores over latent + rope, values over latent
         min(keys, C * selected) * m.kv_bytes + 2 * C * H / g * (2 * lat + rope)),
        _gemm(C, H * lat, m.v_head_dim, g, weight_bytes_per=2),  # W_UV back out of the latent
    )
    active = m.experts_per_token + m.n_shared_experts
    expert = 3 * h * m.moe_intermediate_size
    moe = (2 * C * active * expert / g + 2 * C * h * m.n_routed_experts,
           (experts_touched(m, C) + m.n_shared_experts) * expert / g + 2 * C * h * (1 + active) / g)
    return [OpGroup("projections", *projections, "fp8"), OpGroup("indexer", *indexer, "fp8"),
            OpGroup("sparse_attention", *attention, "bf16"), OpGroup("moe_ffn", *moe, "fp8")]


def compute_time(m: ModelDims, machine: Machine, chunk: int, prefix: int, efficiency: float) -> float:
    """T_comp of Eq. 4 (s): one layer's work on the chunk, the window that hides the next layer's load."""
    return sum(g.time_s(machine, efficiency) for g in layer_op_groups(m, machine, chunk, prefix))


# ---- Eq. 2, 3, 5 -----------------------------------------------------------------------------------------
def prefix_payload_bytes(m: ModelDims, prefix: int, kv_offloaded: bool) -> float:
    """D_hist of Eq. 2 (bytes): one layer's prefix state to load, ``L / r * (s_I + s_V)``: the exact
    index keys, plus the MLA KV when it lives on the host (as HiSparse keeps it)."""
    return prefix / m.key_stride * (m.index_key_bytes + (m.kv_bytes if kv_offloaded else 0))


def new_state_bytes(m: ModelDims, chunk: int, kv_offloaded: bool) -> float:
    """D_new of Eq. 3 (bytes): the chunk's new keys (and KV, when offloaded) written back to host over the
    same link, serialized with the load."""
    return prefix_payload_bytes(m, chunk, kv_offloaded)


def load_time(m: ModelDims, machine: Machine, chunk: int, prefix: int, kv_offloaded: bool) -> float:
    """T_load of Eq. 3 (s): ``delta + (D_hist + D_new) / beta``."""
    moved = prefix_payload_bytes(m, prefix, kv_offloaded) + new_state_bytes(m, chunk, kv_offloaded)
    return machine.delay_s + moved / machine.host_bps


def wait_time(m: ModelDims, machine: Machine, chunk: int, prefix: int, efficiency: float,
              kv_offloaded: bool) -> float:
    """T_wait of Eq. 5 (s): how long compute stalls for the next layer's buffer,
    ``max(0, T_load - T_comp)``."""
    return max(0.0, load_time(m, machine, chunk, prefix, kv_offloaded)
               - compute_time(m, machine, chunk, prefix, efficiency))


def break_even_chunk(m: ModelDims, machine: Machine, prefix: int, efficiency: float, kv_offloaded: bool,
                     max_chunk: int = MAX_CHUNK) -> int | None:
    """The smallest chunk (tokens, a multiple of 64) with ``T_comp >= T_load`` on a prefix of ``prefix``
    tokens: powers of two from 64 up, then bisection to 64 tokens. None: not even ``max_chunk`` (a power
    of two) hides the load. Assumes ``T_comp - T_load`` grows with the chunk (compute grows faster
    than writeback)."""

    def hidden(chunk: int) -> bool:
        return compute_time(m, machine, chunk, prefix, efficiency) >= load_time(m, machine, chunk, prefix,
                                                                                 kv_offloaded)

    hi = 64
    while not hidden(hi):
        if hi >= max_chunk:
            return None
        hi *= 2
    lo = hi // 2  # fails (or is below 64)
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


def prefix_state_peak(m: ModelDims, prefix: int, kv_offloaded: bool) -> dict[str, float]:
    """Peak GPU bytes of loaded prefix state for one request: ``streaming`` holds two layers' payloads
    (the double buffer), ``resident`` every layer's (index keys in indexer layers, KV in all layers)."""
    resident = prefix / m.key_stride * (m.indexer_layers * m.index_key_bytes
                                        + (m.num_layers * m.kv_bytes if kv_offloaded else 0))
    return {"streaming": 2 * prefix_payload_bytes(m, prefix, kv_offloaded), "resident": resident}


# ---- Eq. 1 and admission ------------------------------------------------------------------------------
def activation_bytes(m: ModelDims, machine: Machine, chunk: int) -> float:
    """W_act of Eq. 1 (bytes), roughly: the residual stream and normed input plus the larger of the
    attention activations (absorbed queries and latent outputs of this GPU's heads) and the MoE ones
    (FP8 dispatched tokens and the active experts' intermediate), in bf16."""
    h, heads = m.hidden_size, m.num_attention_heads / machine.gpus
    active = m.experts_per_token + m.n_shared_experts
    attention = 2 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    moe = active * h + 2 * active * 2 * m.moe_intermediate_size / machine.gpus
    return chunk * (2 * 2 * h + max(attention, moe))


def prefill_reservation(m: ModelDims, machine: Machine, chunk: int, prefix: int, code_bytes: float | None,
                        kv_offloaded: bool, score_rows: int | None = None,
                        ivf_budget: int | None = None) -> dict[str, float]:
    """W_p of Eq. 1 (bytes) for one chunk in flight, with its terms.

    I_cap: one layer's prefix and new index keys, when exact keys live on the host (PQ modes; the exact
    mode reads resident keys in place). V_cap: one layer's prefix KV, when offloaded. R_s: the staging
    ring for the chunk's new KV in every layer until written back, when offloaded. W_scratch: the
    indexer's fp32 logits for ``score_rows`` queries at a time (default: the whole chunk) over all keys.

    ``ivf_budget``: the prefill selects through the runtime's causal IVF with that many candidates per
    query instead of scoring every key. W_scratch is then the candidates' positions and scores, and
    W_ivf the index state of the request (:data:`IVF_STATE_BYTES` per key in every indexer layer) plus
    one layer's prefix dequantized while it selects.
    """
    keys = (prefix + chunk) / m.key_stride
    i_cap = keys * m.index_key_bytes if code_bytes is not None else 0.0
    v_cap = prefix / m.key_stride * m.kv_bytes if kv_offloaded else 0.0
    staging = chunk / m.key_stride * m.kv_bytes * m.num_layers if kv_offloaded else 0.0
    w_act = activation_bytes(m, machine, chunk)
    rows = min(score_rows or chunk, chunk)
    w_ivf = 0.0
    if ivf_budget is None:
        w_scratch = rows * keys * LOGIT_BYTES
    else:
        w_scratch = rows * min(ivf_budget, keys) * CANDIDATE_BYTES
        w_ivf = keys * (IVF_STATE_BYTES * m.indexer_layers + FLOAT_KEY_BYTES * m.index_head_dim)
    total = 2 * (i_cap + v_cap) + staging + w_act + w_scratch + w_ivf
    return {"I_cap": i_cap, "V_cap": v_cap, "R_s": staging, "W_act": w_act, "W_scratch": w_scratch,
            "W_ivf": w_ivf, "W_p": total}


def request_state_bytes(m: ModelDims, tokens: int, code_bytes: float | None, kv_offloaded: bool,
                        cache_rows: int = DECODE_CACHE_ROWS, tail_rows: int = TAIL_ROWS) -> float:
    """GPU bytes one decoding request of ``tokens`` tokens keeps, on every GPU of the instance.

    Index: exact keys of every token (``code_bytes`` None), or ``code_bytes`` of PQ codes per token plus
    ``cache_rows`` cached and ``tail_rows`` recent exact keys, in each indexer layer. MLA KV: every
    token's entry in every layer (resident), or only the top-k working set (offloaded).
    """
    entries = tokens / m.key_stride
    if code_bytes is None:
        index = entries * m.index_key_bytes
    else:
        index = entries * code_bytes + min(entries, cache_rows + tail_rows) * m.index_key_bytes
    kv = min(entries, m.index_topk) if kv_offloaded else entries
    return m.indexer_layers * index + m.num_layers * kv * m.kv_bytes


def admission(m: ModelDims, machine: Machine, tokens: int, code_bytes: float | None, kv_offloaded: bool,
              chunk: int, weights: float | None = None, cache_rows: int = DECODE_CACHE_ROWS,
              score_rows: int | None = None, ivf_budget: int | None = None) -> dict[str, float]:
    """How many requests of ``tokens`` tokens fit: the usable HBM of one GPU, less its share of the
    weights (``weights`` bytes in all; default :func:`weight_bytes`) and the reservation W_p for one
    chunk in flight (the last chunk of such a request, the largest), divided by one request's state.
    Returns the count (0 when nothing fits) and the byte terms."""
    per_gpu_weights = (weight_bytes(m) if weights is None else weights) / machine.gpus
    reserve = prefill_reservation(m, machine, chunk, max(0, tokens - chunk), code_bytes, kv_offloaded,
                                  score_rows, ivf_budget)["W_p"]
    budget = machine.hbm_bytes * machine.usable_fraction - per_gpu_weights - reserve
    state = request_state_bytes(m, tokens, code_bytes, kv_offloaded, cache_rows)
    return {"requests": max(0, math.floor(budget / state)), "state_bytes": state, "budget_bytes": budget,
            "weights_bytes": per_gpu_weights, "reservation_bytes": reserve}


def admission_table(m: ModelDims, machine: Machine, contexts: Sequence[int], chunk: int,
                    modes: Mapping[str, float | None] = INDEX_MODES, weights: float | None = None,
                    cache_rows: int = DECODE_CACHE_ROWS, score_rows: int | None = None,
                    ivf_budget: int | None = None) -> list[dict[str, Any]]:
    """:func:`admission` for every context length, index mode (name -> code bytes) and KV placement: one
    row per context, ``{"context", "requests": {"<mode>/<kv>": n}, "state_bytes": {...}}``."""
    rows = []
    for tokens in contexts:
        counts, states = {}, {}
        for mode, code in modes.items():
            for kv in KV_MODES:
                fit = admission(m, machine, tokens, code, kv == "offloaded", chunk, weights, cache_rows,
                                score_rows, ivf_budget)
                counts[f"{mode}/{kv}"], states[f"{mode}/{kv}"] = fit["requests"], fit["state_bytes"]
        rows.append({"context": tokens, "requests": counts, "state_bytes": states})
    return rows


PLUGIN_MODES = ("engine", "plugin_device", "plugin_host")


def engine_pool(m: ModelDims, machine: Machine, contexts: Sequence[int], code_bytes: float, chunk: int = 4096,
                weights: float | None = None) -> dict[str, Any]:
    """The tokens an engine's KV pool admits on one GPU, and the requests of each length in ``contexts``,
    without the engine plugins (``engine``: every layer's MLA KV and exact index keys in HBM) and with them:
    ``plugin_device`` (``DSAINDEX_KEYS=device``: the keys stay and the selector's ``code_bytes`` per key
    and indexer layer come on top) and ``plugin_host`` (``DSAINDEX_KEYS=host``: the codes replace the keys
    in HBM). The pool gets what the weights and one prefill chunk's reservation (the exact indexer's,
    :func:`prefill_reservation`) leave of the usable HBM, as the engines size it from free memory."""
    per_gpu_weights = (weight_bytes(m) if weights is None else weights) / machine.gpus
    longest = max(contexts)
    reserve = prefill_reservation(m, machine, min(chunk, longest), max(0, longest - chunk), None, False)["W_p"]
    budget = machine.hbm_bytes * machine.usable_fraction - per_gpu_weights - reserve
    kv = m.num_layers * m.kv_bytes / m.key_stride
    keys = m.indexer_layers * m.index_key_bytes / m.key_stride
    codes = m.indexer_layers * code_bytes / m.key_stride
    per_token = {"engine": kv + keys, "plugin_device": kv + keys + codes, "plugin_host": kv + codes}
    tokens = {mode: max(0, math.floor(budget / b)) for mode, b in per_token.items()}
    return {"code_bytes": code_bytes, "budget_bytes": budget, "weights_bytes": per_gpu_weights,
            "reservation_bytes": reserve, "bytes_per_token": per_token,
            "index_bytes_per_token": {"engine": keys, "plugin_device": keys + codes, "plugin_host": codes},
            "tokens": tokens,
            "requests": [{"context": n, **{mode: tokens[mode] // n for mode in PLUGIN_MODES}} for n in contexts],
            "gain": {mode: tokens[mode] / tokens["engine"] - 1 if tokens["engine"] else None
                     for mode in PLUGIN_MODES[1:]}}


def streaming_plan(m: ModelDims, machine: Machine, chunk: int, prefix: int,
                   efficiency: float) -> dict[str, Any]:
    """Eq. 2-5 for one layer and the prefix-state peaks, for each payload: index keys only (MLA KV
    resident) and index keys + MLA KV (offloaded). Times in s, sizes in bytes."""
    groups = layer_op_groups(m, machine, chunk, prefix)
    comp = compute_time(m, machine, chunk, prefix, efficiency)
    plan: dict[str, Any] = {
        "compute_groups": {g.name: {"flops": g.flops, "hbm_bytes": g.hbm_bytes, "precision": g.precision,
                                    "time_s": g.time_s(machine, efficiency)} for g in groups},
    }
    for label, offloaded in (("index_keys", False), ("index_keys+mla_kv", True)):
        load = load_time(m, machine, chunk, prefix, offloaded)
        plan[label] = {
            "load_bytes": prefix_payload_bytes(m, prefix, offloaded) + new_state_bytes(m, chunk, offloaded),
            "load_s": load, "compute_s": comp, "wait_s": max(0.0, load - comp),
            "break_even_chunk": break_even_chunk(m, machine, prefix, efficiency, offloaded),
            "peak_bytes": prefix_state_peak(m, prefix, offloaded),
        }
    return plan


def with_overrides(machine: Machine, **changes: Any) -> Machine:
    """``machine`` with the given fields replaced, ``None`` values ignored (CLI options left unset)."""
    return replace(machine, **{k: v for k, v in changes.items() if v is not None})
