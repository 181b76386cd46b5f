"""Torch references of the CUDA/Triton pieces of vLLM's FlashMLA-sparse decode that do not run on the CPU.

Each stands in for one kernel at the lowest level, with the kernel's own signature, so vLLM's Python around
it (``DeepseekV32Attention._sparse_indexer_and_attn``, ``FlashMLASparseImpl.forward_mqa`` /
``_forward_bf16_kv`` / ``_bf16_flash_mla_kernel``, ``SparseMLAIndexGroup``, the metadata builder) runs as
it is:

* :func:`flash_mla_sparse_fwd` - FlashMLA's ``sparse_prefill_fwd`` (vllm/third_party/flashmla/
  flash_mla_interface.py), the kernel ``_bf16_flash_mla_kernel`` calls for a BF16 latent cache;
* :func:`convert_req_index_to_global_index` - the Triton ``sparse_mla_index_remap_kernel`` behind
  ``triton_convert_req_index_to_global_index`` (v1/attention/backends/mla/sparse_utils.py): request-local
  key positions -> rows of the flat latent cache, through the block table;
* :func:`compute_token_to_req_indices` - the Triton kernel of v1/attention/ops/metadata.py;
* :func:`concat_mla_q` - ``torch.ops._C_cache_ops.concat_mla_q``;
* :class:`HostStream` / :class:`HostEvent` - CUDA streams and events (the CPU runs in order).

:func:`exact_mla_decode` is the independent spec the tests compare vLLM's output with: MLA decode attention
over a given set of request-local positions, computed densely from the latent cache, no slot conversion.
"""

from __future__ import annotations

import torch


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse attention, per its contract: ``q`` [s_q, h_q, d_qk] bf16, ``kv`` [s_kv, 1, d_qk] bf16,
    ``indices`` [s_q, 1, topk] int32 (rows of ``kv``; ``-1`` or ``>= s_kv`` invalid), ``topk_length`` [s_q]
    (query i reads ``indices[i, :, :topk_length[i]]`` only). Query i attends, softmax(sm_scale * q . k), to
    exactly the valid rows it reads; values are the first ``d_v`` dims of the same rows (MLA: V is the latent).
    Returns (output [s_q, h_q, d_v] bf16, max_logits [s_q, h_q], lse [s_q, h_q]); a row with no valid index
    gives output 0 and lse -inf."""
    assert attn_sink is None and kv.shape[1] == 1 and indices.shape[1] == 1 and d_v == 512
    s_q, h_q, _ = q.shape
    rows = kv[:, 0].float()
    output = torch.zeros(s_q, h_q, d_v, dtype=torch.float32)
    max_logits = torch.full((s_q, h_q), float("-inf"))
    lse = torch.full((s_q, h_q), float("-inf"))
    for i in range(s_q):
        idx = indices[i, 0].long()
        if topk_length is not None:
            idx = idx[: int(topk_length[i])]
        idx = idx[(idx >= 0) & (idx < rows.shape[0])]
        if idx.numel() == 0:
            continue
        k = rows[idx]  # [n, d_qk]
        logits = (q[i].float() @ k.T) * sm_scale  # [h_q, n]
        max_logits[i] = logits.max(dim=1).values
        lse[i] = torch.logsumexp(logits, dim=1)
        output[i] = torch.softmax(logits, dim=1) @ k[:, :d_v]
    if out is not None:
        out.copy_(output)
        return out, max_logits, lse
    return output.to(q.dtype), max_logits, lse


def convert_req_index_to_global_index(req_id, block_table, token_indices, BLOCK_SIZE: int = 64,  # noqa: N803
                                      BLOCK_STRIDE_ROWS: int | None = None, NUM_TOPK_TOKENS: int = 2048,
                                      BLOCK_N: int = 128, HAS_PREFILL_WORKSPACE: bool = False,
                                      prefill_workspace_request_ids=None, prefill_workspace_starts=None,
                                      prefill_workspace_rank_stride=None, dcp_size: int = 1, dcp_rank: int = 0,
                                      cp_kv_cache_interleave_size: int = 1, return_valid_counts: bool = False,
                                      out=None, valid_counts_out=None, idx_mapping=None):
    """``sparse_mla_index_remap_kernel`` for the decode case (no prefill workspace, no DCP): entry j of token t,
    a request-local position p (``-1``: none), becomes ``block_table[req, p // BLOCK_SIZE] * BLOCK_STRIDE_ROWS
    + p % BLOCK_SIZE`` with ``req = req_id[t]`` (through ``idx_mapping`` when given); ``-1`` stays ``-1``, and so
    does a position whose block is past the table's width. With ``return_valid_counts`` the kernel also
    compacts (``COMPACT_TO_FRONT=return_valid_counts``): the valid slots move, in order (one tile per row for
    top-k <= 4096), to the front, -1 after them, and the count per row is returned."""
    assert not HAS_PREFILL_WORKSPACE and dcp_size == 1, "the reference covers decode rows without DCP"
    assert token_indices.shape[1] == NUM_TOPK_TOKENS and NUM_TOPK_TOKENS % BLOCK_N == 0
    stride = BLOCK_STRIDE_ROWS if BLOCK_STRIDE_ROWS is not None else BLOCK_SIZE
    req = req_id.long()
    if idx_mapping is not None:
        req = idx_mapping.long()[req].clamp_min(0)
    tok = token_indices.long()
    block = torch.div(tok, BLOCK_SIZE, rounding_mode="floor")
    invalid = (tok < 0) | (block < 0) | (block >= block_table.shape[1])
    base = block_table.long()[req.unsqueeze(1).expand_as(block), block.clamp(0, block_table.shape[1] - 1)]
    slots = torch.where(invalid, -1, base * stride + tok % BLOCK_SIZE)
    counts = (~invalid).sum(dim=1).to(torch.int32)
    if return_valid_counts:  # stable compaction: valid first, in their order
        order = torch.sort(invalid.to(torch.int8), dim=1, stable=True).indices
        slots = torch.gather(slots, 1, order)
    result = slots.to(torch.int32)
    if out is not None:
        out.copy_(result)
        result = out
    if not return_valid_counts:
        return result
    if valid_counts_out is not None:
        valid_counts_out.copy_(counts)
        counts = valid_counts_out
    return result, counts


def compute_token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int,
                                 num_tokens: int) -> torch.Tensor:
    """Token t < ``num_mapped_tokens`` -> the request whose ``[query_start_loc[r], query_start_loc[r + 1])``
    holds it; later tokens -> 0."""
    t = torch.arange(num_tokens)
    req = torch.searchsorted(query_start_loc[1:].long().contiguous(), t, right=True)
    out[:num_tokens] = torch.where(t < num_mapped_tokens, req, 0).to(out.dtype)
    return out[:num_tokens]


def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor) -> None:
    """``q_out[:, :H] = cat(ql_nope, q_pe)`` for the ``H`` heads of the inputs (``q_out`` may have more)."""
    heads = ql_nope.shape[1]
    q_out[:, :heads, : ql_nope.shape[2]] = ql_nope
    q_out[:, :heads, ql_nope.shape[2] :] = q_pe


class HostEvent:
    """A CUDA event on the CPU: work is already in order, so recording and waiting are no-ops."""

    def record(self, stream=None) -> None:
        pass


class HostStream:
    """A CUDA stream on the CPU (see :class:`HostEvent`)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc) -> None:
        return None


def exact_mla_decode(latent_cache: torch.Tensor, block_table: torch.Tensor, row_request: list[int],
                     selected: list[torch.Tensor], ql_nope: torch.Tensor, q_pe: torch.Tensor, w_uv: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """MLA decode attention over chosen keys, the spec: query row r (of request ``row_request[r]``) attends to
    the request-local positions ``selected[r]`` (any order, no -1), read from ``latent_cache`` [blocks, 64, 576]
    through ``block_table``; logits ``scale * [ql_nope, q_pe] . latent``, values the 512-d latent, then each
    head's ``W_UV`` [H, 512, V]. Returns [rows, H * V] float32."""
    page = latent_cache.shape[1]
    rows = []
    for r, positions in enumerate(selected):
        pos = positions.long()
        blocks = block_table[row_request[r]].long()[pos // page]
        k = latent_cache[blocks, pos % page].float()  # [n, 576]
        q = torch.cat([ql_nope[r], q_pe[r]], dim=-1).float()  # [H, 576]
        p = torch.softmax(q @ k.T * scale, dim=-1)  # [H, n]
        o = p @ k[:, : w_uv.shape[1]]  # [H, 512]
        rows.append(torch.bmm(o.unsqueeze(1), w_uv.float()).reshape(-1))  # [H * V]
    return torch.stack(rows)
