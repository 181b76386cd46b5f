"""Indexer geometry of a DSA model, read from its transformers config.

The geometry is everything the offline tools and the runtime must agree on about a model's lightning
indexer: which layers run one, how many heads and dims it has, how many keys it keeps, how RoPE is laid
out over the key, and how keys map to token positions (V4 scores compressed entries, one per ``m``
tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from dsaindex.errors import UnsupportedModelError

Family = Literal["deepseek_v32", "glm_moe_dsa", "deepseek_v4"]
FAMILIES: tuple[str, ...] = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")

# How RoPE sits inside the indexer's key/query vector.
#   half_split_head:  rotary on dims [0, r), pairs (i, i + r/2)       (DeepSeek-V3.2)
#   interleaved_head: rotary on dims [0, r), pairs (2i, 2i + 1)       (GLM-5)
#   interleaved_tail: rotary on dims [D - r, D), pairs (2i, 2i + 1)   (DeepSeek-V4)
RopeLayout = Literal["half_split_head", "interleaved_head", "interleaved_tail"]

# Engines (SGLang, vLLM) keep indexer keys as FP8 e4m3 with one power-of-two (ue8m0) scale per token.
ENGINE_KEY_FORMAT = "fp8_e4m3_ue8m0"


def visible_key_count(positions: Any, key_stride: int = 1) -> Any:
    """The causal rule, in one place: keys a query at token ``positions`` may score.

    ``pos + 1`` (V3.2, GLM-5: key ``t`` is token ``t``) or ``(pos + 1) // m`` (V4: compressed entry ``t``
    covers tokens ``[t*m, (t+1)*m)`` and is visible only once complete). Works elementwise on an int,
    a numpy array or an integer tensor, and returns the same kind.
    """
    return (positions + 1) // key_stride


@dataclass(frozen=True)
class IndexerGeometry:
    """What a DSA model's indexer looks like.

    Attributes
    ----------
    family : one of :data:`FAMILIES` (the transformers ``model_type``).
    num_layers : decoder layers in the model.
    indexer_layers : ids of the layers that run their own indexer (GLM-5 "shared" layers and V4
        layers without compressed sparse attention have none).
    n_heads, head_dim : indexer query heads and the dim of one head (= the key dim).
    topk : keys kept per query (2048 on V3.2/GLM-5, 512 on V4).
    rope_dim : dims of the key that carry RoPE; ``rope_layout`` says where and how.
    key_stride : tokens per key; 1, or V4's compression rate m (key ``e`` becomes visible to the
        query at position ``p`` only when ``e < (p + 1) // m``).
    key_format : how engines store keys on the GPU.
    """

    family: str
    num_layers: int
    indexer_layers: tuple[int, ...]
    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    rope_layout: str
    key_stride: int = 1
    key_format: str = ENGINE_KEY_FORMAT

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["indexer_layers"] = list(self.indexer_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndexerGeometry:
        d = dict(d)
        d["indexer_layers"] = tuple(int(i) for i in d["indexer_layers"])
        return cls(**d)

    def visible_keys(self, position: int) -> int:
        """Number of keys a query at token ``position`` may score (its causal prefix)."""
        return visible_key_count(position, self.key_stride)

    def keys_for_tokens(self, num_tokens: int) -> int:
        """Keys a sequence of ``num_tokens`` tokens produces (V4 drops an incomplete last window)."""
        return num_tokens // self.key_stride


def geometry_from_config(config: Any) -> IndexerGeometry:
    """Read the indexer geometry from a transformers config object (or a plain dict).

    Raises
    ------
    UnsupportedModelError
        The model type is not a DSA family, or the config has no indexer.
    """
    get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
        lambda k, default=None: getattr(config, k, default)
    )
    model_type = get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"Model type {model_type!r} has no DeepSeek Sparse Attention indexer this project knows.",
            f"use a model of one of the families {', '.join(FAMILIES)} (or a built-in preset: "
            "`dsaindex capture --model preset:tiny-v32`).",
        )
    n_heads, head_dim, topk = get("index_n_heads"), get("index_head_dim"), get("index_topk")
    if not n_heads or not head_dim or not topk:
        raise UnsupportedModelError(
            f"The {model_type} config has no indexer (index_n_heads={n_heads}, "
            f"index_head_dim={head_dim}, index_topk={topk}).",
            "point at a checkpoint whose config.json sets index_n_heads, index_head_dim and index_topk.",
        )
    num_layers = int(get("num_hidden_layers"))
    if model_type == "deepseek_v32":
        layers = tuple(range(num_layers))
        rope_dim, layout, stride = int(get("qk_rope_head_dim")), "half_split_head", 1
    elif model_type == "glm_moe_dsa":
        types = get("indexer_types") or ["full"] * num_layers
        layers = tuple(i for i, t in enumerate(types) if t == "full")
        rope_dim, layout, stride = int(get("qk_rope_head_dim")), "interleaved_head", 1
    else:
        types = get("layer_types") or []
        layers = tuple(i for i, t in enumerate(types) if t == "compressed_sparse_attention")
        rates = get("compress_rates") or {}
        stride = int(rates.get("compressed_sparse_attention", 4))
        rope_dim = int(get("qk_rope_head_dim") or head_dim * get("partial_rotary_factor"))
        layout = "interleaved_tail"
    if not layers:
        raise UnsupportedModelError(
            f"The {model_type} config has no layer that runs an indexer.",
            "use a config where at least one layer is a full-indexer (GLM-5) or compressed sparse "
            "attention (V4) layer.",
        )
    return IndexerGeometry(
        family=model_type,
        num_layers=num_layers,
        indexer_layers=layers,
        n_heads=int(n_heads),
        head_dim=int(head_dim),
        topk=int(topk),
        rope_dim=rope_dim,
        rope_layout=layout,
        key_stride=stride,
    )
