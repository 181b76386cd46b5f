"""Training of the reference DSA checkpoint: a small ``DeepseekV32ForCausalLM`` trained from scratch
with DeepSeek-V3.2's indexer recipe.

Data
----
Real text present on any machine with Python: the standard library's ``.py`` sources plus the ``.py``
files of the installed packages (the running interpreter's site-packages). Tokens are raw bytes
(0..255); documents are joined with EOS (257); every training / evaluation window starts with BOS (256)
followed by ``seq_len - 1`` bytes of the stream. Whole files are held out for evaluation: a file is
held out when the hash of its path relative to its root (``stdlib/...`` or ``site-packages/...``) falls
below ``heldout_percent``, so the split is the same on every machine that has the same file.

Recipe (three stages, each a function below)
--------------------------------------------
1. ``dense``: ordinary language-model pre-training with dense causal attention (index_topk >= context,
   so the indexer selects every key; its parameters are not trained).
2. ``warmup``: everything but the indexers is frozen. Per layer, the indexer's distribution
   ``softmax_t(score[s, t])`` over the causal prefix is fitted to the main attention distribution
   (attention probabilities summed over heads, L1-normalized per query) with KL divergence. The
   indexer's inputs are detached from the main model's graph.
3. ``sparse``: the main model trains with top-k sparse attention (the indexer's top ``index_topk``
   keys per query, causal prefix only); the indexer keeps its KL loss, restricted to the selected set
   (target and indexer distributions both renormalized over the set). The top-k is not
   differentiable and the indexer inputs are detached, so the LM loss reaches only the main model
   and the KL loss only the indexers.

The training forward below runs the model's own submodules (projections, norms, MLPs, rotary
embedding) in the same order as ``DeepseekV32Attention.forward``, but calls fused attention kernels
and a chunked, differentiable indexer score. Tests check that it reproduces the transformers forward.

A run (:func:`train_reference` with :class:`ReferenceTrainOptions`) chains the stages, saves the
checkpoint and writes its reports. The configs (reference geometry and its tiny CPU variant) are in
:mod:`dsaindex.pipelines.presets`.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsaindex.pipelines.corpus import stdlib_root, walk_files
from dsaindex.pipelines.presets import (
    BOS_ID,
    EOS_ID,
    REFERENCE_CONFIG,
    TINY_REFERENCE_CONFIG,
    model_class,
    reference_config,
)

ROPE_LAYOUT = "half_split_head"


# ----------------------------------------------------------------------------------------------- data


def python_source_roots() -> list[tuple[str, Path]]:
    """``(label, folder)`` of the text sources: the stdlib and the running interpreter's site-packages."""
    roots = [("stdlib", stdlib_root())]
    seen = {roots[0][1].resolve()}
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append(("site-packages", p))
    return roots


def list_python_files(max_file_bytes: int = 400_000) -> list[tuple[str, Path]]:
    """Every non-empty ``.py`` file under :func:`python_source_roots`, as ``(key, path)`` with ``key`` =
    ``label/relative/path`` (the split key). The stdlib walk skips its site-packages (read as its own
    root). Files above ``max_file_bytes`` (generated tables) are left out."""
    return [
        (f"{label}/{p.relative_to(root).as_posix()}", p)
        for label, root in python_source_roots()
        for p in walk_files(root, {".py"}, skip_hidden=True, max_bytes=max_file_bytes)
    ]


def path_hash(key: str) -> float:
    """Deterministic value in [0, 100) from a path key (sha256), used for the split and the order."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 * 100.0


def is_heldout(key: str, heldout_percent: float) -> bool:
    """Whole-file split: ``key`` is held out when its hash falls below ``heldout_percent``."""
    return path_hash(key) < heldout_percent


@dataclass
class TokenStreams:
    """Byte-token streams: ``train`` / ``heldout`` are 1-D int16 numpy arrays (documents joined with EOS)."""

    train: Any
    heldout: Any
    info: dict = field(default_factory=dict)


def build_token_streams(
    max_train_bytes: int = 160_000_000,
    max_heldout_bytes: int = 8_000_000,
    heldout_percent: float = 2.0,
    files: list[tuple[str, Path]] | None = None,
) -> TokenStreams:
    """Read the corpus into train / held-out token streams.

    Files are taken in the order of a second hash of their key (so a byte budget samples every package
    rather than the alphabetically first ones) until each budget is reached. Raw file bytes are the
    tokens (UTF-8 sources); each document is followed by EOS.
    """
    import numpy as np

    files = list_python_files() if files is None else files
    order = sorted(files, key=lambda kp: path_hash("order:" + kp[0]))
    parts: dict[str, list[Any]] = {"train": [], "heldout": []}
    used = {"train": 0, "heldout": 0}
    counts = {"train": 0, "heldout": 0}
    budget = {"train": max_train_bytes, "heldout": max_heldout_bytes}
    eos = np.array([EOS_ID], dtype=np.int16)
    for key, path in order:
        split = "heldout" if is_heldout(key, heldout_percent) else "train"
        if used[split] >= budget[split]:
            if all(used[s] >= budget[s] for s in used):
                break
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        parts[split] += [np.frombuffer(data, dtype=np.uint8).astype(np.int16), eos]
        used[split] += len(data) + 1
        counts[split] += 1
    streams = {s: (np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype=np.int16)) for s in parts}
    info = {
        "roots": [f"{label}: {root}" for label, root in python_source_roots()],
        "files_available": len(files),
        "train_files": counts["train"],
        "heldout_files": counts["heldout"],
        "train_tokens": int(streams["train"].size),
        "heldout_tokens": int(streams["heldout"].size),
        "heldout_percent": heldout_percent,
        "split": "whole files; held out when sha256(label/relative_path) maps below heldout_percent of 100",
    }
    return TokenStreams(streams["train"], streams["heldout"], info)


@dataclass
class Vocabulary:
    """The tokens of a run: ``size`` entries, the BOS / EOS / PAD ids, the tokenizer (None: raw bytes) and
    the bytes of text per token on held-out text (bits per byte = bits per token / bytes_per_token)."""

    size: int
    bos: int
    eos: int
    pad: int
    tokenizer: Path | None = None
    bytes_per_token: float = 1.0


BYTE_VOCABULARY = Vocabulary(size=260, bos=BOS_ID, eos=EOS_ID, pad=259)
TOKEN_CACHE = "tokens.npz"


def corpus_vocabulary(corpus: Path) -> Vocabulary:
    """The vocabulary of a corpus built by ``dsaindex reference corpus`` (its ``tokenizer.json``, whose
    special tokens are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``)."""
    from tokenizers import Tokenizer

    from dsaindex.errors import DsaIndexError

    path = corpus / "tokenizer.json"
    if not path.is_file():
        raise DsaIndexError(f"{corpus} has no tokenizer.json: it is not a corpus built by `dsaindex reference corpus`.",
                            f"build one with `dsaindex reference corpus {corpus}`, or pass its folder.")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")]
    if None in ids:
        raise DsaIndexError(f"{path} lacks the special tokens <|bos|>, <|eos|>, <|pad|>.",
                            "rebuild the corpus with `dsaindex reference corpus`.")
    return Vocabulary(size=tok.get_vocab_size(), bos=ids[0], eos=ids[1], pad=ids[2], tokenizer=path)


def corpus_token_streams(corpus: Path, max_train_tokens: int | None = None,
                         max_heldout_tokens: int | None = None) -> tuple[TokenStreams, Vocabulary]:
    """Token streams of a ``dsaindex reference corpus`` folder: its ``train.jsonl`` / ``heldout.jsonl``
    documents in file order, each tokenized with the folder's ``tokenizer.json`` and followed by EOS.

    The tokens are cached in ``tokens.npz`` beside them, keyed by the tokenizer's and the documents'
    digests; a folder holding only ``tokenizer.json`` and a matching ``tokens.npz`` (a copy carried to a
    machine without the text) is enough. Returns the streams (uint16) and the vocabulary, with
    ``bytes_per_token`` measured on the held-out split."""
    import numpy as np

    from dsaindex.errors import DsaIndexError

    vocab = corpus_vocabulary(corpus)
    tok_digest = hashlib.sha256(vocab.tokenizer.read_bytes()).hexdigest()[:16]
    texts = {split: corpus / f"{split}.jsonl" for split in ("train", "heldout")}
    have_text = all(p.is_file() for p in texts.values())
    text_digest = (hashlib.sha256(b"".join(str(p.stat().st_size).encode() for p in texts.values())).hexdigest()[:16]
                   if have_text else None)
    cache = corpus / TOKEN_CACHE
    cached = None
    if cache.is_file():
        with np.load(cache) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["tokenizer"] == tok_digest and (text_digest is None or meta["text"] == text_digest):
                cached = {"train": z["train"], "heldout": z["heldout"], "meta": meta}
    if cached is None:
        if not have_text:
            raise DsaIndexError(f"{corpus} has neither its documents (train.jsonl, heldout.jsonl) nor tokens "
                                f"({TOKEN_CACHE}) of this tokenizer.", "pass the folder `dsaindex reference corpus` wrote.")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(vocab.tokenizer))
        arrays, counts = {}, {}
        for split, path in texts.items():
            docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
            parts = []
            for start in range(0, len(docs), 256):
                for enc in tok.encode_batch(docs[start : start + 256]):
                    parts += [np.asarray(enc.ids, dtype=np.uint16), np.array([vocab.eos], dtype=np.uint16)]
            arrays[split] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
            counts[split] = {"documents": len(docs), "bytes": sum(len(d.encode()) for d in docs)}
        meta = {"tokenizer": tok_digest, "text": text_digest, "documents": counts}
        tmp = cache.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, train=arrays["train"], heldout=arrays["heldout"],
                            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        tmp.replace(cache)
        cached = {**arrays, "meta": meta}
    meta = cached["meta"]
    held = meta["documents"]["heldout"]
    vocab.bytes_per_token = held["bytes"] / max(1, cached["heldout"].size - held["documents"])
    train = cached["train"] if max_train_tokens is None else cached["train"][:max_train_tokens]
    heldout = cached["heldout"] if max_heldout_tokens is None else cached["heldout"][:max_heldout_tokens]
    info = {"corpus": str(corpus), "tokenizer": f"byte-level BPE, {vocab.size} entries (sha256 {tok_digest})",
            "train_documents": meta["documents"]["train"]["documents"],
            "heldout_documents": held["documents"], "train_tokens": int(train.size),
            "heldout_tokens": int(heldout.size), "heldout_bytes_per_token": round(vocab.bytes_per_token, 4),
            "split": "whole documents, as the corpus builder held them out"}
    return TokenStreams(train.astype(np.int32), heldout.astype(np.int32), info), vocab


def checkpoint_streams(name: str, own_tokenizer: str | None, corpus: Path | None, vocab_size: int,
                       train_tokens: int, heldout_tokens: int,
                       heldout_percent: float = 2.0) -> tuple[TokenStreams, Vocabulary]:
    """The token streams a checkpoint ``name`` is trained or measured on, at most ``train_tokens`` /
    ``heldout_tokens`` of each split: ``corpus``'s own tokens (a ``dsaindex reference corpus`` folder), or
    without it the byte-token Python sources. Refused, naming the fix: a checkpoint with its own tokenizer
    (``own_tokenizer``, its name; ``None`` for byte tokens) and no corpus, which would be fed byte tokens,
    and a corpus whose vocabulary the checkpoint's ``vocab_size`` entries cannot hold."""
    from dsaindex.errors import DsaIndexError

    if corpus is None:
        if own_tokenizer is not None:
            raise DsaIndexError(f"{name} has its own tokenizer ({own_tokenizer}); without --corpus it would be fed "
                                "byte tokens.",
                                "pass --corpus with the corpus it was trained on (the folder `dsaindex reference "
                                "corpus` wrote), or a byte-token checkpoint such as -m reference-v1.")
        return (build_token_streams(train_tokens, heldout_tokens, heldout_percent=heldout_percent),
                BYTE_VOCABULARY)
    streams, vocab = corpus_token_streams(corpus, max_train_tokens=train_tokens, max_heldout_tokens=heldout_tokens)
    if vocab.size > vocab_size:
        raise DsaIndexError(f"{corpus} has a vocabulary of {vocab.size:,} entries; the model has {vocab_size:,}.",
                            "pass the corpus the checkpoint was trained on, or leave --corpus out for a byte-token "
                            "checkpoint (reference-v1).")
    return streams, vocab


def sample_windows(stream, batch: int, seq_len: int, generator, bos: int = BOS_ID) -> tuple[Any, Any]:
    """Random training windows.

    Parameters
    ----------
    stream : 1-D int tensor of tokens (on the training device)
    generator : ``torch.Generator`` on the stream's device

    Returns
    -------
    input_ids [batch, seq_len] int64 (``bos``, then ``seq_len - 1`` stream tokens) and labels
    [batch, seq_len] int64 (the next token at every position).
    """
    import torch

    starts = torch.randint(0, stream.numel() - seq_len, (batch,), device=stream.device, generator=generator)
    idx = starts[:, None] + torch.arange(seq_len, device=stream.device)[None, :]
    chunk = stream[idx].long()  # [B, S]
    first = torch.full((batch, 1), bos, dtype=torch.long, device=stream.device)
    return torch.cat([first, chunk[:, :-1]], dim=1), chunk


def heldout_windows(stream, seq_len: int, max_windows: int, bos: int = BOS_ID) -> tuple[Any, Any]:
    """Consecutive non-overlapping held-out windows, same layout as :func:`sample_windows`.

    Returns input_ids [N, seq_len] and labels [N, seq_len] (int64, on the stream's device).
    """
    import torch

    n = min(max_windows, stream.numel() // seq_len)
    chunk = stream[: n * seq_len].view(n, seq_len).long()
    first = torch.full((n, 1), bos, dtype=torch.long, device=stream.device)
    return torch.cat([first, chunk[:, :-1]], dim=1), chunk


# ---------------------------------------------------------------------------------------------- model


def build_model(config: Any, seed: int = 0, device: str = "cpu") -> Any:
    """A freshly initialized ``DeepseekV32ForCausalLM`` (fp32) for ``config``
    (:func:`dsaindex.pipelines.presets.reference_config`)."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class("deepseek_v32")(config)
    return model.float()


def load_checkpoint(path: str | Path, device: str = "cpu") -> Any:
    """``DeepseekV32ForCausalLM.from_pretrained(path, local_files_only=True)`` in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    return model.to(device).eval()


def set_index_topk(model, k: int) -> None:
    """Keys each indexer keeps: the config value and every indexer module's cached copy."""
    model.config.index_topk = int(k)
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = int(k)


def is_indexer_param(name: str) -> bool:
    return ".self_attn.indexer." in name


def indexer_parameters(model) -> list:
    """Parameters of every layer's ``self_attn.indexer`` (wq_b, wk, k_norm, weights_proj)."""
    return [p for n, p in model.named_parameters() if is_indexer_param(n)]


def main_parameters(model) -> list:
    """Every parameter that is not an indexer's."""
    return [p for n, p in model.named_parameters() if not is_indexer_param(n)]


# ------------------------------------------------------------------------------------ training forward


def rope_interleave(x, cos, sin):
    """MLA RoPE as in ``apply_rotary_pos_emb_interleave``: pairs ``(2i, 2i+1)`` rotated, output in
    half-split order. ``x`` [B, heads, S, r]; ``cos``/``sin`` [B, S, r] (angles repeated twice)."""
    import torch

    c = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    s = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_qkv(attn, x, cos, sin):
    """Main-attention tensors of one ``DeepseekV32Attention`` for its (normed) input.

    Parameters
    ----------
    x : [B, S, hidden] (the layer's ``input_layernorm`` output); cos, sin : [B, S, qk_rope_head_dim]

    Returns
    -------
    q [B, nh, S, qk_head_dim], k [B, nh, S, qk_head_dim], v [B, nh, S, v_head_dim],
    q_resid [B, S, q_lora_rank] (the indexer's query input).
    """
    import torch

    b, s, _ = x.shape
    nope, rope_d, vd = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(b, s, -1, nope + rope_d).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope_d], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, rope_d], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_pass)).view(b, s, -1, nope + vd).transpose(1, 2)
    k_nope, v = torch.split(kv, [nope, vd], dim=-1)
    q_rot = rope_interleave(q_rot, cos, sin)
    k_rot = rope_interleave(k_rot.view(b, 1, s, rope_d), cos, sin)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return q, k, v, q_resid


def _chunk_index_scores(queries, keys, weights):
    """Indexer scores of a query chunk: ``sum_h w[h] * relu(q[h] . k)``.

    queries [B, c, H, D], keys [B, T, D], weights [B, c, H] (effective) -> [B, c, T] float32.
    One [B, c*H, D] x [B, D, T] product, then a per-query [1, H] x [H, T] weighted sum over heads.
    """
    import torch

    b, c, h, d = queries.shape
    t = keys.shape[1]
    logits = torch.bmm(queries.reshape(b, c * h, d), keys.transpose(1, 2))  # [B, c*H, T]
    relu = torch.relu(logits).view(b * c, h, t)
    out = torch.bmm(weights.reshape(b * c, 1, h).to(relu.dtype), relu)  # [B*c, 1, T]
    return out.view(b, c, t).float()


def indexer_kl_layer(
    indexer, x, q_resid, cos, sin, q, k, scaling: float, topk: int | None, query_chunk: int = 256
):
    """KL loss of one layer's indexer against its main attention, and the top-k selection mask.

    Parameters
    ----------
    indexer : the layer's ``DeepseekV32Indexer``
    x : [B, S, hidden] indexer hidden-state input; q_resid : [B, S, q_lora_rank]; both are detached here
    cos, sin : [B, S, rope_dim]
    q, k : [B, nh, S, qk_head_dim] main-attention queries / keys (used without gradient)
    topk : ``None`` for the dense warm-up (KL over the whole causal prefix), else the number of keys
        kept per query (KL over the selected set; the set is returned as the attention mask)
    query_chunk : queries per step (bounds the [B, chunk, H, T] intermediate; each chunk is
        recomputed in backward)

    Returns
    -------
    (kl: scalar tensor, mean over queries of KL(p_main || softmax(score)); allowed: [B, S, S] bool
    mask of the keys each query may attend (top-k within its causal prefix), or ``None`` when dense).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from dsaindex.indexer import mla_indexer_tensors

    b, s, _ = x.shape
    keys, queries, weights = mla_indexer_tensors(indexer, ROPE_LAYOUT, x.detach(), q_resid.detach(), cos, sin)
    allowed_full = torch.zeros(b, s, s, dtype=torch.bool, device=x.device) if topk is not None else None
    kl_sum = x.new_zeros((), dtype=torch.float32)
    q_det, k_det = q.detach(), k.detach()
    positions = torch.arange(s, device=x.device)
    for s0 in range(0, s, query_chunk):
        s1 = min(s, s0 + query_chunk)
        t = s1  # keys beyond the chunk's last query are never visible
        if torch.is_grad_enabled():
            scores = checkpoint(
                _chunk_index_scores, queries[:, s0:s1], keys[:, :t], weights[:, s0:s1], use_reentrant=False
            )
        else:
            scores = _chunk_index_scores(queries[:, s0:s1], keys[:, :t], weights[:, s0:s1])  # [B, c, t]
        causal = positions[:t][None, :] <= positions[s0:s1][:, None]  # [c, t]
        with torch.no_grad():
            if topk is None:
                allowed = causal.expand(b, -1, -1)
            else:
                kk = min(topk, t)
                idx = scores.detach().masked_fill(~causal, -math.inf).topk(kk, dim=-1).indices
                allowed = torch.zeros(b, s1 - s0, t, dtype=torch.bool, device=x.device).scatter_(
                    -1, idx, True
                )
                allowed &= causal
                allowed_full[:, s0:s1, :t] = allowed
            logits = (
                torch.matmul(q_det[:, :, s0:s1].float(), k_det[:, :, :t].float().transpose(-1, -2)) * scaling
            )
            p = torch.softmax(logits.masked_fill(~allowed[:, None], -math.inf), dim=-1).mean(1)  # [B, c, t]
            log_p = torch.log(p.clamp_min(1e-30))
        log_q = F.log_softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).masked_fill(~allowed, 0.0)
        kl = (p * (log_p - log_q)).masked_fill(~allowed, 0.0).sum(-1)  # [B, c]
        kl_sum = kl_sum + kl.sum()
    return kl_sum / (b * s), allowed_full


def topk_allowed(indexer, x, q_resid, cos, sin, topk: int, query_chunk: int = 256):
    """[B, S, S] bool: the keys each query may attend with top-``topk`` sparse attention (the indexer's
    top-k of its causal prefix), computed without gradients, chunk by chunk (long contexts)."""
    import torch

    from dsaindex.indexer import mla_indexer_tensors

    b, s, _ = x.shape
    with torch.no_grad():
        keys, queries, weights = mla_indexer_tensors(indexer, ROPE_LAYOUT, x, q_resid, cos, sin)
        allowed = torch.zeros(b, s, s, dtype=torch.bool, device=x.device)
        positions = torch.arange(s, device=x.device)
        for s0 in range(0, s, query_chunk):
            s1 = min(s, s0 + query_chunk)
            scores = _chunk_index_scores(queries[:, s0:s1], keys[:, :s1], weights[:, s0:s1])
            causal = positions[:s1][None, :] <= positions[s0:s1][:, None]
            idx = scores.masked_fill(~causal, -math.inf).topk(min(topk, s1), dim=-1).indices
            chunk = torch.zeros(b, s1 - s0, s1, dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
            allowed[:, s0:s1, :s1] = chunk & causal
    return allowed


def indexer_kl_sampled(indexer, x, q_resid, cos, sin, q, k, scaling: float, rows, allowed=None):
    """KL of one layer's indexer against its main attention at the query positions ``rows`` [n] only
    (sorted, int64): what makes the indexer losses of a 32K window fit. ``allowed`` [B, S, S] (sparse
    training) restricts both distributions to each query's selected keys; None: the causal prefix.
    Returns the mean KL over the sampled queries (a scalar with gradients into the indexer only)."""
    import torch
    import torch.nn.functional as F

    from dsaindex.indexer import mla_indexer_tensors

    b = x.shape[0]
    t = int(rows[-1]) + 1  # keys past the last sampled query are never visible
    keys, queries, weights = mla_indexer_tensors(indexer, ROPE_LAYOUT, x.detach(), q_resid.detach(), cos, sin,
                                                 query_rows=rows)
    scores = _chunk_index_scores(queries, keys[:, :t], weights)  # [B, n, t]
    visible = torch.arange(t, device=x.device)[None, :] <= rows[:, None]  # [n, t]
    mask = visible.expand(b, -1, -1) if allowed is None else allowed[:, rows, :t] & visible
    with torch.no_grad():
        logits = torch.matmul(q.detach()[:, :, rows].float(), k.detach()[:, :, :t].float().transpose(-1, -2)) * scaling
        p = torch.softmax(logits.masked_fill(~mask[:, None], -math.inf), dim=-1).mean(1)  # [B, n, t]
        log_p = torch.log(p.clamp_min(1e-30))
    log_q = F.log_softmax(scores.masked_fill(~mask, -math.inf), dim=-1).masked_fill(~mask, 0.0)
    return (p * (log_p - log_q)).masked_fill(~mask, 0.0).sum(-1).mean()


def chunked_attention(q, k, v, scale: float, allowed=None, chunk: int = 2048):
    """Causal (or ``allowed`` [B, S, S]-masked) attention over query chunks of ``chunk`` rows, each one
    recomputed in backward: a 32K window's masked attention without a [B, heads, S, S] intermediate."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    s = q.shape[2]
    positions = torch.arange(s, device=q.device)
    outs = []
    for s0 in range(0, s, chunk):
        s1 = min(s, s0 + chunk)
        if allowed is None:
            mask = (positions[:s1][None, :] <= positions[s0:s1][:, None])[None, None]
        else:
            mask = allowed[:, None, s0:s1, :s1]
        args = (q[:, :, s0:s1], k[:, :, :s1], v[:, :, :s1])
        if torch.is_grad_enabled():
            outs.append(checkpoint(F.scaled_dot_product_attention, *args, attn_mask=mask, scale=scale,
                                   use_reentrant=False))
        else:
            outs.append(F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)


def sampled_rows(seq_len: int, count: int, generator, device) -> Any:
    """``count`` distinct query positions of a window, sorted (int64), drawn uniformly; always including
    the last (the longest prefix)."""
    import torch

    if count >= seq_len:
        return torch.arange(seq_len, device=device)
    g_dev = getattr(generator, "device", torch.device("cpu"))
    picks = torch.randperm(seq_len - 1, generator=generator, device=g_dev)[: count - 1].to(device)
    return torch.cat([picks.sort().values, torch.tensor([seq_len - 1], device=device)])


@dataclass
class ForwardResult:
    """Losses of one training forward: ``lm`` (mean next-token cross-entropy, nats), ``kl`` (mean over
    layers of the per-query indexer KL), ``task`` (mean cross-entropy of the passkey answer tokens) and
    ``objective`` (the LM loss minimized: ``lm`` with the answer tokens weighted); each ``None`` when the
    mode or batch does not compute it."""

    lm: Any = None
    kl: Any = None
    task: Any = None
    objective: Any = None


def run_layers(model, input_ids, attend: Callable[..., Any]):
    """The decoder stack of a ``DeepseekV32ForCausalLM`` as its forward runs it, with each layer's attention
    chosen by the caller: ``attend(i, attn, x, q, k, v, q_resid, cos, sin)`` returns the attention output
    [B, heads, S, v_dim] of layer ``i`` (``x`` its normed input, ``q``/``k``/``v`` from :func:`mla_qkv`), or
    None to stop there. Returns the last hidden state [B, S, hidden] (before the final norm), or None when
    stopped."""
    import torch

    core = model.model
    b, s = input_ids.shape
    h = core.embed_tokens(input_ids)
    position_ids = torch.arange(s, device=input_ids.device)[None, :].expand(b, -1)
    cos, sin = core.rotary_emb(h, position_ids)
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v, q_resid = mla_qkv(attn, x, cos, sin)
        o = attend(i, attn, x, q, k, v, q_resid, cos, sin)
        if o is None:
            return None
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def training_forward(model, input_ids, labels, mode: str, topk: int | None = None, query_chunk: int = 256,
                     kl_rows=None, attn_chunk: int | None = None, answer=None, answer_weight: float = 1.0):
    """One forward pass of the recipe.

    Parameters
    ----------
    model : ``DeepseekV32ForCausalLM``
    input_ids, labels : [B, S] int64
    mode : ``dense`` (LM loss, dense causal attention), ``warmup`` (indexer KL over the causal prefix; the
        main model's output and LM loss are not computed), ``sparse`` (LM loss with top-``topk`` sparse
        attention + indexer KL over the selected set)
    kl_rows : [n] sorted query positions: the indexer KL is computed at these queries only
        (:func:`indexer_kl_sampled`; long windows), the top-k for every query without gradients
    attn_chunk : main attention over query chunks of this many rows (:func:`chunked_attention`), so a
        sparse 32K window needs no [B, heads, S, S] intermediate
    answer : [B, S] bool, the labels that are passkey answers (:mod:`reference_tasks`); their
        cross-entropy is reported as ``task`` and weighs ``answer_weight`` times a token in ``objective``
    """
    import torch
    import torch.nn.functional as F

    assert mode in ("dense", "warmup", "sparse"), mode
    if mode == "sparse":
        assert topk is not None
    kls = []
    n_layers = len(model.model.layers)

    def attend(i, attn, x, q, k, v, q_resid, cos, sin):
        if mode == "dense":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        if mode == "warmup":
            if kl_rows is not None:
                kl = indexer_kl_sampled(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, kl_rows)
            else:
                kl, _ = indexer_kl_layer(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, None, query_chunk)
            kls.append(kl)
            if i == n_layers - 1:
                return None  # the warm-up needs no output
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        if kl_rows is not None:
            allowed = topk_allowed(attn.indexer, x.detach(), q_resid.detach(), cos, sin, topk, query_chunk)
            kl = indexer_kl_sampled(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, kl_rows, allowed)
        else:
            kl, allowed = indexer_kl_layer(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, topk, query_chunk)
        kls.append(kl)
        if attn_chunk:
            return chunked_attention(q, k, v, attn.scaling, allowed, attn_chunk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=attn.scaling)

    h = run_layers(model, input_ids, attend)
    result = ForwardResult(kl=torch.stack(kls).mean() if kls else None)
    if mode != "warmup":
        logits = model.lm_head(model.model.norm(h)).float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        result.lm = result.objective = ce.mean()
        if answer is not None and bool(answer.any()):
            mask = answer.reshape(-1)
            result.task = ce[mask].mean()
            weights = 1.0 + (answer_weight - 1.0) * mask.float()
            result.objective = (ce * weights).sum() / weights.sum()
    return result


# ------------------------------------------------------------------------------------------- training


@dataclass
class StageConfig:
    """One stage: ``mode`` (dense / warmup / sparse), its limits (``max_steps`` and/or ``seconds``;
    the first reached ends it; the learning-rate schedule follows whichever is closer to its end),
    batch shape and optimizer settings."""

    name: str
    mode: str
    batch: int
    seq_len: int
    lr: float
    max_steps: int | None = None
    seconds: float | None = None
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    indexer_lr: float | None = None  # sparse stage: learning rate of the indexer parameters
    topk: int | None = None
    query_chunk: int = 256
    kl_queries: int | None = None  # indexer KL on this many sampled queries per window (None: every query)
    attn_chunk: int | None = None  # sparse main attention over query chunks of this many rows
    passkey_share: float = 0.0  # share of windows rewritten into passkey tasks (reference_tasks)
    answer_weight: float = 1.0  # loss weight of passkey answer tokens, against 1 per token


@dataclass
class StageResult:
    name: str
    mode: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_lm_loss: float | None = None
    final_kl: float | None = None
    final_task_loss: float | None = None  # passkey answers, mean over the last logged steps (nats)
    peak_memory_gb: float | None = None
    config: dict = field(default_factory=dict)


def configure_trainable(model, mode: str) -> tuple[list, list]:
    """Set ``requires_grad`` for a stage; returns ``(main params trained, indexer params trained)``.

    dense: main only; warmup: indexers only (main frozen); sparse: both (their losses are separate).
    """
    train_main = mode in ("dense", "sparse")
    train_idx = mode in ("warmup", "sparse")
    for n, p in model.named_parameters():
        p.requires_grad_(train_idx if is_indexer_param(n) else train_main)
    return (main_parameters(model) if train_main else []), (indexer_parameters(model) if train_idx else [])


def make_optimizer(model, cfg: StageConfig):
    """AdamW over the stage's trainable parameters (fused on CUDA); norms and 1-D params get no decay."""
    import torch

    main, idx = configure_trainable(model, cfg.mode)
    groups = []
    for params, lr in ((main, cfg.lr), (idx, cfg.indexer_lr if cfg.indexer_lr is not None else cfg.lr)):
        if not params:
            continue
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups.append({"params": decay, "weight_decay": cfg.weight_decay, "lr": lr, "base_lr": lr})
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr": lr, "base_lr": lr})
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_factor(cfg: StageConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` over the stage."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = 0.0
    if cfg.max_steps:
        progress = max(progress, step / cfg.max_steps)
    if cfg.seconds:
        progress = max(progress, elapsed / cfg.seconds)
    progress = min(1.0, progress)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(
    model, optimizer, input_ids, labels, cfg: StageConfig, autocast: bool = False, generator=None,
    answer=None, focus=None,
) -> ForwardResult:
    """One optimizer step of a stage; returns the (detached) losses. ``answer`` and ``focus`` come from
    :class:`~dsaindex.pipelines.reference_tasks.PasskeyTasks`: the answer labels (weighted by
    ``cfg.answer_weight``) and the positions always added to the indexer KL's sampled queries."""
    import torch

    device_type = input_ids.device.type
    rows = None
    if cfg.kl_queries and cfg.mode in ("warmup", "sparse"):
        rows = sampled_rows(input_ids.shape[1], cfg.kl_queries, generator, input_ids.device)
        if focus is not None and focus.numel():
            rows = torch.unique(torch.cat([rows, focus.to(rows.device)]))  # sorted, the last position kept
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=autocast):
        res = training_forward(model, input_ids, labels, cfg.mode, cfg.topk, cfg.query_chunk, rows, cfg.attn_chunk,
                               answer, cfg.answer_weight)
    loss = sum(x for x in (res.objective, res.kl) if x is not None)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return ForwardResult(*(None if x is None else x.detach() for x in (res.lm, res.kl, res.task)))


def run_stage(
    model,
    stream,
    cfg: StageConfig,
    generator,
    history: list[dict],
    step_offset: int = 0,
    autocast: bool = False,
    log: Callable[[str], None] | None = None,
    log_every: int = 25,
    bos: int = BOS_ID,
    tasks: Any = None,
) -> StageResult:
    """Train one stage until ``max_steps`` or ``seconds``; appends ``{step, stage, lm, kl, task, time}`` rows
    to ``history`` (losses synchronized every ``log_every`` steps, to keep the GPU busy in between).
    ``tasks`` (a :class:`~dsaindex.pipelines.reference_tasks.PasskeyTasks`) rewrites a share of the
    sampled windows into passkey tasks; ``task`` is then the answer tokens' loss."""
    import torch

    optimizer = make_optimizer(model, cfg)
    model.train()
    if stream.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    result = StageResult(cfg.name, cfg.mode, config=asdict(cfg))
    start = time.perf_counter()
    step = 0
    pending: list[tuple[int, ForwardResult, float]] = []

    def flush():
        for st, res, el in pending:
            row = {"step": step_offset + st, "stage": cfg.name, "time": el}
            row["lm"] = None if res.lm is None else float(res.lm)
            row["kl"] = None if res.kl is None else float(res.kl)
            row["task"] = None if res.task is None else float(res.task)
            history.append(row)
            result.final_lm_loss, result.final_kl = row["lm"], row["kl"]
        tasks_seen = [r["task"] for r in history[len(history) - len(pending):] if r["task"] is not None]
        if tasks_seen:
            result.final_task_loss = sum(tasks_seen) / len(tasks_seen)
        if pending and log:
            r = history[-1]
            lm = "-" if r["lm"] is None else f"{r['lm'] / math.log(2):.4f} bits"
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            task = "" if not tasks_seen else f" answers={sum(tasks_seen) / len(tasks_seen):.3f} nats"
            log(f"[{cfg.name}] step {r['step'] - step_offset} t={r['time']:.0f}s lm={lm} kl={kl}{task}")
        pending.clear()

    while True:
        elapsed = time.perf_counter() - start
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        if cfg.seconds is not None and elapsed >= cfg.seconds:
            break
        factor = lr_factor(cfg, step, elapsed)
        for g in optimizer.param_groups:
            g["lr"] = g["base_lr"] * factor
        input_ids, labels = sample_windows(stream, cfg.batch, cfg.seq_len, generator, bos)
        answer = focus = None
        if tasks is not None:
            batch = tasks.apply(input_ids, labels)
            input_ids, labels, answer, focus = batch.input_ids, batch.labels, batch.answer, batch.focus
        res = train_step(model, optimizer, input_ids, labels, cfg, autocast, generator, answer, focus)
        pending.append((step, res, elapsed))
        step += 1
        if step % log_every == 0:
            flush()
    flush()
    if stream.is_cuda:
        torch.cuda.synchronize()
        result.peak_memory_gb = torch.cuda.max_memory_allocated() / 2**30
    result.steps = step
    result.tokens = step * cfg.batch * cfg.seq_len
    result.seconds = time.perf_counter() - start
    for p in model.parameters():
        p.requires_grad_(True)
    return result


# ------------------------------------------------------------------------------------------- saving


def save_checkpoint(model, out_dir: Path, index_topk: int) -> dict:
    """``config.json`` + ``model.safetensors`` (bf16, in shards of 15 MB at most; indexer ``weights_proj``
    kept fp32 as the class loads it), with ``index_topk`` in the config. Returns ``{"params", "safetensors_bytes"}``."""
    import copy

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    clone = copy.deepcopy(model).cpu()
    clone.to(torch.bfloat16)
    for layer in clone.model.layers:
        layer.self_attn.indexer.weights_proj.float()
    set_index_topk(clone, index_topk)
    clone.config.use_cache = True
    # shards of at most 15 MB: small enough to travel back from a GPU machine one file at a time
    clone.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size="15MB")
    size = sum(p.stat().st_size for p in out_dir.glob("model*.safetensors"))
    return {"params": sum(p.numel() for p in model.parameters()), "safetensors_bytes": size}


def save_tokenizer(vocab: Vocabulary, out_dir: Path) -> None:
    """The run's BPE tokenizer as transformers loads it beside the weights (``tokenizer.json`` and a
    ``tokenizer_config.json`` naming its BOS / EOS / PAD tokens), so ``AutoTokenizer`` and capture
    separate documents with the right EOS."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(vocab.tokenizer), bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>")
    tok.save_pretrained(str(out_dir))


def plot_loss_curve(history: list[dict], path: Path) -> None:
    """Loss curve: LM loss in bits per byte (dense and sparse stages) and indexer KL (warm-up, sparse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    colors = {"dense": "tab:blue", "warmup": "tab:orange", "sparse": "tab:green"}
    for stage in ("dense", "warmup", "sparse"):
        rows = [r for r in history if r["stage"] == stage]
        lm = [(r["step"], r["lm"] / math.log(2)) for r in rows if r["lm"] is not None]
        kl = [(r["step"], r["kl"]) for r in rows if r["kl"] is not None]
        if lm:
            ax1.plot(*zip(*lm, strict=True), color=colors[stage], label=f"{stage}: train LM loss", lw=0.8)
        if kl:
            ax2.plot(*zip(*kl, strict=True), color=colors[stage], label=f"{stage}: indexer KL", lw=0.8)
    ax1.set_ylabel("bits per byte (train batch)")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("KL (nats per query, mean over layers)")
    ax2.set_yscale("log")
    ax2.set_xlabel("optimizer step")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle("Reference DSA checkpoint: dense pre-training -> indexer warm-up -> sparse training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- a run


@dataclass
class ReferenceTrainOptions:
    """Settings of one run of the recipe (``dsaindex reference train``; its ``--help`` describes each one,
    and takes its defaults from here).

    Stage limits: ``*_steps`` (``None``: none) and the wall-clock budget ``minutes`` split by ``*_frac``;
    the first limit reached ends a stage. ``stages`` lists the stages to run, comma-separated; with
    ``init_from`` the run continues the checkpoint saved there and keeps the lineage of its runs.
    ``command`` is recorded in ``metrics.json`` and the model card as the way to reproduce the run.
    ``corpus`` trains on a ``dsaindex reference corpus`` folder with its BPE tokenizer (the v2 data;
    ``max_train_mb`` / ``max_heldout_mb`` then count millions of tokens) instead of Python sources as bytes;
    ``rope_theta`` and ``max_position`` set a fresh model's RoPE base and position limit (a continued
    checkpoint keeps its own); ``layers`` sets a fresh model's depth (every layer a dense MLP and an indexer,
    as in the reference geometry; more layers give cross-layer reuse plans more to choose from).
    ``passkey_share`` of the windows (a corpus run only) carry fresh passkey
    tasks (:class:`~dsaindex.pipelines.reference_tasks.PasskeyTasks`, up to ``passkey_questions`` questions
    each) whose answer tokens weigh ``passkey_weight`` in the loss.
    """

    out: Path = Path("reference_model")
    minutes: float = 8.0
    dense_frac: float = 0.55
    warmup_frac: float = 0.10
    sparse_frac: float = 0.35
    dense_steps: int | None = None
    warmup_steps: int | None = None
    sparse_steps: int | None = None
    seq_len: int = 4096
    topk: int = 256
    dense_batch: int = 16
    warmup_batch: int = 8
    sparse_batch: int = 8
    dense_lr: float = 2e-3
    warmup_lr: float = 1e-3
    sparse_lr: float = 5e-4
    sparse_indexer_lr: float = 5e-4
    query_chunk: int = 256
    max_train_mb: float = 160.0
    max_heldout_mb: float = 4.0
    heldout_percent: float = 2.0
    eval_windows: int = 32
    coverage_windows: int = 8
    tiny: bool = False
    log_every: int = 25
    seed: int = 0
    device: str = "auto"
    init_from: Path | None = None
    stages: str = "dense,warmup,sparse"
    command: str = ""
    corpus: Path | None = None
    rope_theta: float = 10000.0
    max_position: int | None = None
    kl_queries: int | None = None
    attn_chunk: int | None = None
    passkey_share: float = 0.0
    passkey_weight: float = 1.0
    passkey_questions: int = 4
    layers: int | None = None


STAGES = ("dense", "warmup", "sparse")


def parse_stages(stages: str) -> list[str]:
    """The stages of a comma-separated list, in order; refuses unknown names and an empty list."""
    names = [x.strip() for x in stages.split(",") if x.strip()]
    unknown = sorted(set(names) - set(STAGES))
    if unknown or not names:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"Unknown stages {unknown or stages!r}.", "pass --stages with dense, warmup and/or sparse.")
    return names


def stage_configs(options: ReferenceTrainOptions) -> list[StageConfig]:
    """The recipe's three stages with the run's batch shapes, learning rates and limits."""
    budget = options.minutes * 60.0
    common = dict(seq_len=options.seq_len, query_chunk=options.query_chunk, kl_queries=options.kl_queries,
                  attn_chunk=options.attn_chunk, passkey_share=options.passkey_share,
                  answer_weight=options.passkey_weight)
    return [
        StageConfig("dense", "dense", options.dense_batch, lr=options.dense_lr, max_steps=options.dense_steps,
                    seconds=budget * options.dense_frac, warmup_steps=50, **common),
        StageConfig("warmup", "warmup", options.warmup_batch, lr=options.warmup_lr, max_steps=options.warmup_steps,
                    seconds=budget * options.warmup_frac, warmup_steps=10, min_lr_ratio=0.5, **common),
        StageConfig("sparse", "sparse", options.sparse_batch, lr=options.sparse_lr, max_steps=options.sparse_steps,
                    seconds=budget * options.sparse_frac, warmup_steps=10, indexer_lr=options.sparse_indexer_lr,
                    topk=options.topk, **common),
    ]


def earlier_lineage(init_from: Path | None) -> tuple[list[dict], list[str]]:
    """``(stages, commands)`` of the runs that produced the checkpoint at ``init_from``, from its
    ``metrics.json`` (empty without one), so the card lists every stage the weights went through."""
    earlier = None if init_from is None else init_from / "metrics.json"
    if earlier is None or not earlier.is_file():
        return [], []
    prior = json.loads(earlier.read_text())
    training = prior.get("training", {})
    return (training.get("earlier_stages", []) + training.get("stages", []),
            prior.get("earlier_runs", []) + [prior.get("command", "")])


def machine_description(device: str) -> str:
    """The accelerator (or CPU) and library versions, for the card's reproduction note."""
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, {versions}"
    return f"CPU ({platform.processor() or platform.machine()}), {versions}"


Evaluator = Callable[..., dict[str, Any]]


def train_reference(
    options: ReferenceTrainOptions, log: Callable[[str], None] = print, evaluator: Evaluator | None = None
) -> dict[str, Any]:
    """Train the reference checkpoint and write it with its reports to ``options.out``.

    Builds the token streams, a fresh model (or the one at ``init_from``), runs the chosen stages, saves
    the checkpoint and ``loss_curve.png``, then writes ``metrics.json`` and ``MODEL_CARD.md``.
    ``evaluator`` (:func:`dsaindex.pipelines.reference_eval.evaluate`, passed in because that module
    builds on this one) measures the saved checkpoint on the held-out stream; ``None`` skips evaluation.
    Returns the metrics dictionary.
    """
    import torch

    from dsaindex.console import resolve_device
    from dsaindex.pipelines.reference_card import model_card

    run_stages = parse_stages(options.stages)
    if options.passkey_share and options.corpus is None:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError("Passkey tasks need a corpus run: they are tokenized with the corpus's tokenizer.",
                            "pass --corpus, or leave --passkey-share at 0.")
    dev = resolve_device(options.device)
    cuda = dev.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    if options.corpus is not None:
        streams, vocab = corpus_token_streams(options.corpus, int(options.max_train_mb * 1e6),
                                              int(options.max_heldout_mb * 1e6))
    else:
        streams = build_token_streams(
            int(options.max_train_mb * 1e6), int(options.max_heldout_mb * 1e6), heldout_percent=options.heldout_percent
        )
        vocab = BYTE_VOCABULARY
    log(f"data: {json.dumps(streams.info)} ({time.perf_counter() - t0:.1f}s)")
    train_stream = torch.from_numpy(streams.train).to(dev)
    heldout_stream = torch.from_numpy(streams.heldout).to(dev)

    seq_len, topk = options.seq_len, options.topk
    base = TINY_REFERENCE_CONFIG if options.tiny else REFERENCE_CONFIG
    if options.layers is not None:
        base = {**base, "num_hidden_layers": options.layers, "first_k_dense_replace": options.layers}
    if options.init_from is not None and options.layers is not None:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError("--layers sets a fresh model's depth; a continued checkpoint keeps its own.",
                            "drop --layers, or drop --init-from to train a fresh model of that depth.")
    if options.init_from is not None:
        model = load_checkpoint(options.init_from, dev).train()
        set_index_topk(model, topk)
        log(f"continuing from {options.init_from}")
    else:
        limit = options.max_position or max(base["max_position_embeddings"], seq_len)
        config = reference_config(
            base, index_topk=topk, max_position_embeddings=limit, rope_theta=options.rope_theta,
            vocab_size=vocab.size, bos_token_id=vocab.bos, eos_token_id=vocab.eos, pad_token_id=vocab.pad,
        )
        model = build_model(config, seed=options.seed, device=dev)
    if model.config.vocab_size != vocab.size:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"The checkpoint has {model.config.vocab_size} token entries; this run's data has "
                            f"{vocab.size}.", "continue a checkpoint on the data (and tokenizer) it was trained on.")
    prior_stages, prior_runs = earlier_lineage(options.init_from)
    n_params = sum(p.numel() for p in model.parameters())
    n_index = sum(p.numel() for p in indexer_parameters(model))
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_index / 1e6:.2f}M in indexers), device {dev}")

    generator = torch.Generator(device=dev)
    generator.manual_seed(options.seed)
    tasks = None
    if options.passkey_share:
        from dsaindex.pipelines.reference_tasks import PasskeyTasks

        tasks = PasskeyTasks(vocab.tokenizer, options.passkey_share, seed=options.seed,
                             max_questions=options.passkey_questions)
    history: list[dict[str, Any]] = []
    results = []
    offset = 0
    for cfg in [c for c in stage_configs(options) if c.name in run_stages]:
        res = run_stage(model, train_stream, cfg, generator, history, offset, autocast=cuda, log=log,
                        log_every=options.log_every, bos=vocab.bos, tasks=tasks)
        offset += res.steps
        results.append(res)
        log(
            f"stage {res.name}: {res.steps} steps, {res.tokens / 1e6:.1f}M tokens, {res.seconds:.0f}s, "
            f"peak memory {res.peak_memory_gb or 0:.1f} GiB"
        )

    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    saved = save_checkpoint(model, out, index_topk=topk)
    if vocab.tokenizer is not None:  # shipped beside the weights, with the corpus's sources table
        import shutil

        save_tokenizer(vocab, out)
        if (vocab.tokenizer.parent / "corpus.json").is_file():
            shutil.copyfile(vocab.tokenizer.parent / "corpus.json", out / "corpus.json")
    plot_loss_curve(history, out / "loss_curve.png")
    metrics: dict[str, Any] = {
        "model": {
            "class": "DeepseekV32ForCausalLM",
            "parameters": n_params,
            "indexer_parameters": n_index,
            "safetensors_bytes": saved["safetensors_bytes"],
            "config": {k: v for k, v in base.items() if k != "rope_theta"} | {
                "index_topk": topk, "vocab_size": int(model.config.vocab_size),
                "max_position_embeddings": int(model.config.max_position_embeddings),
                "rope_parameters": dict(getattr(model.config, "rope_parameters", None) or {})},
            "vocabulary": {"entries": vocab.size, "bos": vocab.bos, "eos": vocab.eos, "pad": vocab.pad,
                           "tokenizer": None if vocab.tokenizer is None else "tokenizer.json",
                           "heldout_bytes_per_token": vocab.bytes_per_token},
        },
        "data": streams.info,
        "training": {
            "seq_len": seq_len,
            "seed": options.seed,
            "stages": [vars(r) for r in results],
            "earlier_stages": prior_stages,
            "tokens_total": sum(r.tokens for r in results) + sum(x["tokens"] for x in prior_stages),
            "history_every": 10,
            "history": [r for j, r in enumerate(history) if j % 10 == 0 or j == len(history) - 1],
        },
        "machine": machine_description(dev),
        "corpus": (json.loads((out / "corpus.json").read_text()) if (out / "corpus.json").is_file() else None),
        "command": options.command,
        "earlier_runs": prior_runs,
    }
    if evaluator is not None:
        del model
        if cuda:
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        metrics["eval"] = evaluator(
            load_checkpoint(out, dev),
            heldout_stream,
            seq_len=seq_len,
            topk=topk,
            bpb_windows=options.eval_windows,
            coverage_windows=options.coverage_windows,
            bos=vocab.bos,
            bytes_per_token=vocab.bytes_per_token,
        )
        metrics["eval"]["seconds"] = time.perf_counter() - t1
        log("eval: " + json.dumps({k: v for k, v in metrics["eval"].items() if k != "coverage"}))
        for ctx, cov in metrics["eval"]["coverage"].items():
            log(f"coverage@{ctx}: {cov['coverage']:.4f} (oracle {cov['oracle']:.4f}, window {cov['window']:.4f})")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(metrics))
    log(f"wrote {out} ({time.perf_counter() - t0:.0f}s in all)")
    return metrics
