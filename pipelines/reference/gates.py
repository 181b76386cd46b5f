"""Gates of the long-context reference checkpoint (v2): does its attention reach far back?

Measured at the checkpoint's long context on held-out data, through the training forward of
:mod:`dsaindex.pipelines.reference.train` (fused attention kernels, so 32K tokens fit; dense attention,
or top-k sparse attention selected by the model's own indexer):

* **needle retrieval**: prompts of ``seq_len`` tokens of held-out text with ``keys`` passkey statements
  at random depths, in the corpus's needle format (``The passkey for NAME is VALUE. Remember it.``),
  ending with the question and ``Answer: the passkey for NAME is``; a prompt counts as retrieved when
  every token of the value is the model's argmax (teacher forced). The asked statement lies at least
  ``seq_len / (keys + 1)`` tokens back.
* **true vs shuffled prefix**: the loss on the last ``tail`` tokens of held-out windows, once after their
  own prefix and once after the same prefix with its 256-token blocks shuffled. A model that uses far
  context does better with the true prefix.
* **bits per byte** at the long context, dense and (with ``topk``) sparse.
* **where each layer's exact top-k lies** (:func:`topk_structure`): for the last queries of held-out
  windows, the indexer's top-k over the causal prefix: keys per touched 128-key block (few means the
  selection is scattered, as content retrieval is; many means contiguous runs, which blocks route as
  well as clusters), the share more than 4K positions back, and the main attention's mass inside the
  top-k (coverage) beside the best k keys (oracle) and the most recent k (window).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from dsaindex.indexer import topk_allowed
from dsaindex.pipelines.capture.tokens import heldout_windows
from dsaindex.pipelines.reference.forward import ROPE_LAYOUT, run_layers
from dsaindex.pipelines.reference.synthetic import passkey_question, passkey_statement, passkeys
from dsaindex.pipelines.reference.tasks import answer_tokens
from dsaindex.score import batched_index_scores


def model_logits(model, input_ids, topk: int | None = None, positions: Any = None, query_chunk: int = 256):
    """Logits [B, len(positions), V] float32 of ``model`` (a ``DeepseekV32ForCausalLM``) at ``positions``
    (default: every position), with dense causal attention, or with ``topk`` the top-k keys of each
    layer's indexer (its causal prefix; as sparse training attends)."""
    import torch
    import torch.nn.functional as F

    s = input_ids.shape[1]

    def attend(i, attn, x, q, k, v, q_resid, cos, sin):
        if topk is None or topk >= s:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        allowed = topk_allowed(attn.indexer, x, q_resid, cos, sin, topk, query_chunk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=attn.scaling)

    with torch.no_grad(), torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16,
                                         enabled=input_ids.device.type == "cuda"):
        h = run_layers(model, input_ids, attend)
        if positions is not None:
            h = h[:, positions]
        return model.lm_head(model.model.norm(h)).float()


def needle_prompts(tokenizer_path: Path, filler: Any, seq_len: int, count: int, keys: int = 4, bos: int = 0,
                   seed: int = 0) -> list[tuple[Any, int, int]]:
    """``count`` needle prompts of ``seq_len`` tokens: (input ids [seq_len] int64, first answer position,
    answer tokens). ``filler`` is a 1-D int tensor of held-out tokens (each prompt takes its own slice)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        values = passkeys(rng, keys)
        asked = rng.choice(list(values))
        statements = [tok.encode(passkey_statement(n, v)).ids for n, v in values.items()]
        question = tok.encode(passkey_question(asked)).ids
        answer = answer_tokens(tok, values[asked])
        room = seq_len - 1 - sum(map(len, statements)) - len(question) - len(answer)
        if room < 4 * (keys + 1):
            raise ValueError(f"a context of {seq_len} tokens cannot hold {keys} needle statements, the question and "
                             "filler between them; measure needles at a longer context.")
        start = (i * 7919 * seq_len) % max(1, filler.numel() - room)
        text = filler[start : start + room].tolist()
        # statements at depths spread over the prompt: the i-th in the i-th of keys + 1 equal parts
        cuts = sorted(rng.randrange(j * room // (keys + 1), (j + 1) * room // (keys + 1)) for j in range(keys))
        ids, last = [bos], 0
        for cut, statement in zip(cuts, statements, strict=True):
            ids += text[last:cut] + statement
            last = cut
        ids += text[last:] + question
        first = len(ids)
        ids += answer
        prompts.append((torch.tensor(ids, dtype=torch.long), first, len(answer)))
    return prompts


def needle_accuracy(model, prompts: list[tuple[Any, int, int]], topk: int | None = None) -> float:
    """Share of ``prompts`` whose every answer token is the model's argmax (teacher forced)."""
    import torch

    device = next(model.parameters()).device
    hits = 0
    for ids, first, n in prompts:
        positions = torch.arange(first - 1, first - 1 + n, device=device)
        logits = model_logits(model, ids[None].to(device), topk, positions)
        hits += int(torch.equal(logits[0].argmax(-1).cpu(), ids[first : first + n]))
    return hits / max(1, len(prompts))


def shuffled_prefix_gain(model, stream: Any, seq_len: int, windows: int, tail: int = 1024, block: int = 256,
                         bos: int = 0, seed: int = 0) -> dict[str, float]:
    """Mean loss (nats per token) on the last ``tail`` tokens of held-out windows after their true prefix
    and after it shuffled in ``block``-token blocks; ``gain`` = shuffled - true (positive: far context used)."""
    import torch
    import torch.nn.functional as F

    tail = min(tail, seq_len // 4)
    ids, labels = heldout_windows(stream, seq_len, windows, bos)
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    positions = torch.arange(seq_len - tail, seq_len, device=device)
    losses = {"true": 0.0, "shuffled": 0.0}
    for w in range(ids.shape[0]):
        row, lab = ids[w].to(device), labels[w, seq_len - tail :].to(device)
        n_blocks = (seq_len - tail - 1) // block
        order = torch.randperm(n_blocks, generator=g)
        body = row[1 : 1 + n_blocks * block].view(n_blocks, block)[order.to(device)].reshape(-1)
        shuffled = torch.cat([row[:1], body, row[1 + n_blocks * block :]])
        for name, x in (("true", row), ("shuffled", shuffled)):
            logits = model_logits(model, x[None], positions=positions)[0]
            losses[name] += float(F.cross_entropy(logits, lab)) / ids.shape[0]
    return {**losses, "gain": losses["shuffled"] - losses["true"], "windows": int(ids.shape[0]), "tail": tail}


def long_bits_per_byte(model, stream: Any, seq_len: int, windows: int, bytes_per_token: float, topk: int | None = None,
                       bos: int = 0) -> float:
    """Held-out bits per byte over every position of ``windows`` windows of ``seq_len`` tokens."""
    import torch.nn.functional as F

    ids, labels = heldout_windows(stream, seq_len, windows, bos)
    device = next(model.parameters()).device
    total = 0.0
    for w in range(ids.shape[0]):
        logits = model_logits(model, ids[w : w + 1].to(device), topk)[0]
        total += float(F.cross_entropy(logits, labels[w].to(device)))
    return total / max(1, ids.shape[0]) / math.log(2) / bytes_per_token


def evaluate_gates(model, heldout: Any, tokenizer_path: Path, seq_len: int, bytes_per_token: float, bos: int = 0,
                   needles: int = 20, windows: int = 4, topk: int | None = None) -> dict[str, Any]:
    """The gates measurable from the forward alone (dense, and sparse with ``topk``), as a dict."""
    prompts = needle_prompts(tokenizer_path, heldout, seq_len, needles, bos=bos)
    result: dict[str, Any] = {
        "seq_len": seq_len,
        "needle_accuracy_dense": needle_accuracy(model, prompts),
        "shuffled_prefix": shuffled_prefix_gain(model, heldout, seq_len, windows, bos=bos),
        "bits_per_byte_dense": long_bits_per_byte(model, heldout, seq_len, windows, bytes_per_token, bos=bos),
    }
    if topk is not None:
        result["topk"] = topk
        result["needle_accuracy_sparse"] = needle_accuracy(model, prompts, topk)
        result["bits_per_byte_sparse"] = long_bits_per_byte(model, heldout, seq_len, windows, bytes_per_token, topk,
                                                            bos=bos)
    return result


def random_keys_per_block(prefix: int, k: int, block: int = 128) -> float:
    """Keys per touched ``block``-key block if ``k`` of ``prefix`` keys were picked uniformly at random: the
    floor of that statistic for a scattered selection (a block is untouched with the hypergeometric
    probability C(prefix - block, k) / C(prefix, k)); 2.3 for the top-512 of a 32K prefix."""
    k = min(k, prefix)
    touched = 0.0
    for start in range(0, prefix, block):
        size = min(block, prefix - start)
        if prefix - size < k:
            touched += 1.0
            continue
        log_miss = (math.lgamma(prefix - size + 1) - math.lgamma(prefix - size - k + 1)
                    - math.lgamma(prefix + 1) + math.lgamma(prefix - k + 1))
        touched += 1.0 - math.exp(log_miss)
    return k / touched


def topk_structure(model, stream: Any, seq_len: int, windows: int, topk: int, queries: int = 64, bos: int = 0,
                   block: int = 128, far: int = 4096, open_window: int = 1024) -> dict[str, Any]:
    """Per layer, for the last ``queries`` queries of ``windows`` held-out windows: keys per touched
    ``block``-key block of the indexer's top-``topk`` (``keys_per_block``), the same for the part of it
    more than ``open_window`` positions back (``routed_keys_per_block``: what IVF routing decides, its open
    window being exact), the share more than ``far`` positions back, and the main attention's mass (dense
    forward, probabilities summed over heads, L1-normalized) inside the top-k (``coverage``), inside its
    own best k (``oracle``) and inside the last k keys (``window``). Means over queries; ``layers`` lists
    them per layer, the top level averages the layers. ``random_keys_per_block`` is the floor a uniformly
    scattered top-k would give at the last query's prefix (:func:`random_keys_per_block`)."""
    import torch
    import torch.nn.functional as F

    from dsaindex.indexer import mla_indexer_tensors

    ids, _ = heldout_windows(stream, seq_len, windows, bos)
    device = next(model.parameters()).device
    n_layers = len(model.model.layers)
    sums = [{"keys_per_block": 0.0, "routed_keys_per_block": 0.0, "far_share": 0.0, "coverage": 0.0,
             "oracle": 0.0, "window": 0.0} for _ in range(n_layers)]
    routed_queries = [0] * n_layers
    rows = torch.arange(seq_len - queries, seq_len, device=device)
    visible = torch.arange(seq_len, device=device)[None, :] <= rows[:, None]
    kk = min(topk, seq_len)

    def measure(i, attn, x, q, k, v, q_resid, cos, sin):
        """Layer ``i``'s top-k statistics for the measured queries, then its dense attention."""
        keys, qi, wi = mla_indexer_tensors(attn.indexer, ROPE_LAYOUT, x, q_resid, cos, sin, query_rows=rows)
        top = batched_index_scores(qi, keys, wi)[0].masked_fill(~visible, float("-inf")).topk(kk, dim=-1).indices
        logits = torch.matmul(q[0][:, rows].float(), k[0].float().transpose(-1, -2)) * attn.scaling
        p = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), dim=-1).sum(0)
        p = p / p.sum(-1, keepdim=True)  # [n, S]: the heads' attention, summed and normalized
        blocks = torch.zeros(rows.shape[0], -(-seq_len // block), device=device).scatter_(1, top // block, 1.0)
        recent = (torch.arange(seq_len, device=device)[None, :] > rows[:, None] - kk) & visible
        s = sums[i]
        s["keys_per_block"] += float((kk / blocks.sum(-1)).sum())
        routed = (rows[:, None] - top) >= open_window
        routed_blocks = torch.zeros_like(blocks).scatter_reduce_(1, top // block, routed.float(), reduce="amax")
        has = routed.any(-1)  # queries with a key beyond the open window (others have nothing to route)
        s["routed_keys_per_block"] += float((routed.sum(-1) / routed_blocks.sum(-1).clamp(min=1))[has].sum())
        routed_queries[i] += int(has.sum())
        s["far_share"] += float(((rows[:, None] - top) > far).float().mean(-1).sum())
        s["coverage"] += float(p.gather(1, top).sum(-1).sum())
        s["oracle"] += float(p.topk(kk, dim=-1).values.sum(-1).sum())
        s["window"] += float((p * recent).sum(-1).sum())
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)

    for w in range(ids.shape[0]):
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            run_layers(model, ids[w : w + 1].to(device), measure)
    count = ids.shape[0] * rows.shape[0]
    layers = [{name: value / max(1, routed_queries[i] if name == "routed_keys_per_block" else count)
               for name, value in s.items()} for i, s in enumerate(sums)]
    mean = {name: sum(layer[name] for layer in layers) / n_layers for name in layers[0]}
    return {"seq_len": seq_len, "topk": topk, "queries": count, "block": block, "far": far,
            "open_window": open_window, "random_keys_per_block": round(random_keys_per_block(seq_len, kk, block), 3),
            **mean, "layers": layers}
