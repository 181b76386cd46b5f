"""Every model configuration the project writes itself: the byte vocabulary, the test and bench presets
(``preset:NAME`` model references) and the reference checkpoint's geometry, with the transformers classes
each family maps to.

The dicts are keyword arguments of the family's transformers config class. They are derived from one
another where their values coincide, so each value is written once: the tiny presets share a trunk,
``bench-v32`` and the reference geometry widen the tiny V3.2 one, and the reference's CPU test variant
shrinks the reference. transformers is imported only inside the functions.
"""

from __future__ import annotations

from typing import Any

from dsaindex.errors import ModelNotFoundError

# Byte vocabulary: UTF-8 bytes 0..255, then begin / end of document; 258 and 259 are spare.
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257
PAD_ID = 259  # the reference's padding: a spare slot, which keeps the EOS embedding trainable

_BYTE_TOKENS: dict[str, Any] = dict(vocab_size=260, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)

# What the tiny presets of every family share: a small trunk and MoE, an indexer with production key dims
# (128) but few heads.
_TINY_TRUNK: dict[str, Any] = dict(
    _BYTE_TOKENS,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    index_n_heads=8,
    index_head_dim=128,
    max_position_embeddings=65536,
)

# MLA families (V3.2, GLM-5).
_TINY_MLA: dict[str, Any] = dict(
    _TINY_TRUNK,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    index_topk=32,
)

# Random weights around the production V3.2 indexer (64 heads x 128 dims, top-2048, q_lora_rank 1536), with
# a narrow trunk: for measuring capture at production indexer cost, not for realistic keys.
_BENCH_V32: dict[str, Any] = dict(
    _TINY_MLA,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=8,
    index_n_heads=64,
    index_topk=2048,
    max_position_embeddings=163840,
)

_TINY_V4: dict[str, Any] = dict(
    _TINY_TRUNK,
    head_dim=64,
    index_topk=16,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=32,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
)

# name -> (family, config kwargs): the ``preset:NAME`` model references
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "bench-v32": ("deepseek_v32", _BENCH_V32),
    "tiny-v32": ("deepseek_v32", dict(_TINY_MLA)),
    "tiny-glm5": ("glm_moe_dsa", dict(_TINY_MLA, indexer_types=["full", "full", "shared", "full"])),
    "tiny-v4": ("deepseek_v4", _TINY_V4),
}

# The reference checkpoint's geometry: production V3.2 indexer (64 heads x 128, RoPE on 64 dims, top-256 at
# 4K) on a small dense trunk (``first_k_dense_replace`` = every layer).
REFERENCE_CONFIG: dict[str, Any] = dict(
    _TINY_MLA,
    hidden_size=256,
    intermediate_size=640,
    first_k_dense_replace=4,
    q_lora_rank=96,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_n_heads=64,
    index_topk=256,
    max_position_embeddings=16384,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    pad_token_id=PAD_ID,
)

# A very small variant of the reference class for CPU tests (seconds per step).
TINY_REFERENCE_CONFIG: dict[str, Any] = dict(
    REFERENCE_CONFIG,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
    max_position_embeddings=1024,
)

# family -> (config class, causal-LM class) in transformers
_FAMILY_CLASSES: dict[str, tuple[str, str]] = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
}


def config_class(family: str) -> type:
    """The transformers config class of ``family`` (``deepseek_v32``, ``glm_moe_dsa``, ``deepseek_v4``)."""
    import transformers

    return getattr(transformers, _FAMILY_CLASSES[family][0])


def model_class(family: str) -> type:
    """The transformers causal-LM class of ``family``."""
    import transformers

    return getattr(transformers, _FAMILY_CLASSES[family][1])


def preset_config(name: str) -> Any:
    """The transformers config of preset ``name`` (without the ``preset:`` prefix)."""
    if name not in PRESETS:
        raise ModelNotFoundError(
            f"Unknown preset {name!r}.", f"use one of: {', '.join('preset:' + p for p in PRESETS)}."
        )
    family, kwargs = PRESETS[name]
    return config_class(family)(**kwargs)


def reference_config(base: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """``DeepseekV32Config`` of the reference geometry (or ``base``), with ``overrides``; ``rope_theta``
    becomes the config's default ``rope_parameters``."""
    kwargs = dict(REFERENCE_CONFIG if base is None else base, **overrides)
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return config_class("deepseek_v32")(**kwargs)
