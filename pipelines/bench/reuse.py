"""``dsaindex bench decode-reuse``: one decode step of a production-size layer stack under cross-layer
reuse (IndexCache) and the Multi-layer Indexer (MLI), each arm captured in one CUDA graph.

The stack is ``--layers`` synthetic decoder layers of DeepSeek-V3.2's geometry as one GPU of an 8-GPU
node runs them, per layer and step, for ``B`` requests of ``--context`` keys each:

* the layer's weights are read once (bf16 GEMMs sized in bytes as the FP8 weights one GPU reads),
  before and after attention. ``--parallel tp``, the latency setup: every weight split 8 ways (16
  attention heads per GPU; an eighth of each of the ``256 (1 - (1 - 8/256)^B)`` experts the ``B`` tokens
  hit, and of the shared expert), and two all-reduces per layer, stood in for by a spin kernel of
  ``--comm-us`` each. ``--parallel ep``, the throughput setup: data-parallel attention (128 heads,
  the attention weights whole) and 8-way expert parallelism (the shared expert, and the routed experts
  of its 32 that the node's ``8 B`` tokens hit, ``32 (1 - (1 - 8/256)^(8 B))`` of them on average), no
  all-reduce. The indexer is not split in either (the engines replicate it);
* the indexer (kept layers only): its query projections from the layer input, then the exact scores
  of every prefix key in the engines' paged FP8 cache and the top-2048 (DeepGEMM's paged MQA logits +
  the project's threshold top-k where DeepGEMM imports, else the project's FP8 Triton kernel), or the
  runtime's PQ step over the same paged cache (``--indexer pq``, the engine plugins' selector);
* sparse MLA attention over the selected 2048 keys of a latent cache (576 dims, bf16, gathered), the
  absorbed form: 128 heads.

Arms, per retention 1/N (1 = every layer keeps its indexer; kept layers evenly spaced from layer 0,
as the engines' default):

* ``indexcache``: a kept layer runs its indexer, then attends its own selection; the others attend the
  last kept layer's;
* ``mli``: every layer attends the nearest kept layer before it
  (:func:`dsaindex.artifacts.kinds.lagged_sources`); a kept layer's indexer forks onto a side stream as
  soon as the layer's input exists and runs under the layer's attention and feed-forward; the next
  layer joins it before it attends. The first layer attends its own, computed in line.

Reported per batch size: median ms per step of each arm, tokens per second, and the ratios the
targets name (MLI over IndexCache at the same retention; IndexCache + MLI at 1/4 against IndexCache
at 1/8).
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from dsaindex.pipelines.bench.stream import HIDDEN, INDEX_DIM, INDEX_HEADS, TOPK

ATTN_HEADS, LATENT, ROPE = 128, 512, 64  # MLA: 128 heads over a 512-d latent + 64 rope dims (absorbed)
Q_LORA = 1536  # the query's low-rank dim, from which the indexer's query is projected
ATTN_PARAMS = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168  # MLA projections
EXPERT_PARAMS = 3 * 7168 * 2048  # one expert's gate, up and down projections
EXPERTS, ACTIVE, GPUS = 256, 8, 8  # routed experts, chosen per token, GPUs of the node (expert parallel)
PAGE = 64


def weight_bytes(batch: int, parallel: str = "ep") -> dict[str, int]:
    """FP8 weight bytes one GPU reads per layer and step (module docstring): ``pre`` attention (the query
    and latent projections), ``post`` (the output projection, the shared expert and the routed experts
    hit), for ``batch`` requests on this GPU under ``parallel`` ``tp`` or ``ep``."""
    pre = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
    if parallel == "tp":
        hit = EXPERTS * (1.0 - (1.0 - ACTIVE / EXPERTS) ** batch)
        return {"pre": pre // GPUS,
                "post": round((ATTN_PARAMS - pre + EXPERT_PARAMS + hit * EXPERT_PARAMS) / GPUS)}
    local = EXPERTS // GPUS
    hit = local * (1.0 - (1.0 - ACTIVE / EXPERTS) ** (GPUS * batch))
    return {"pre": pre, "post": ATTN_PARAMS - pre + EXPERT_PARAMS + round(hit * EXPERT_PARAMS)}


def arms(layers: int, retentions: list[int]) -> list[tuple[str, int, list[int], list[int]]]:
    """(arm, N, kept layers, the layer each layer attends) per retention 1/N and schedule."""
    from dsaindex.artifacts.kinds import lagged_sources

    out = []
    order = list(range(layers))
    for n in retentions:
        kept = order[::n]
        plain = [max(k for k in kept if k <= layer) for layer in order]
        out.append(("indexcache", n, kept, plain))
        out.append(("mli", n, kept, lagged_sources(order, kept)))
    return out


class Stack:
    """The synthetic layers' shared weights and caches on ``device``; :meth:`step` runs one decode step
    under a schedule. Weights and caches are shared by the layers (each layer reads more bytes than the
    L2 holds, so sharing changes no traffic); each layer's queries differ, so its selection does."""

    def __init__(self, batch: int, context: int, indexer: str, device: str = "cuda", scale: int = 1,
                 seed: int = 0, parallel: str = "ep", comm_us: float = 0.0):
        import torch

        self.torch = torch
        g = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context, self.indexer, self.device = batch, context, indexer, device
        hidden = HIDDEN // scale
        self.hidden = hidden
        dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
        per = weight_bytes(batch, parallel)
        self.comm_cycles = 0
        if parallel == "tp" and comm_us > 0 and device.startswith("cuda"):
            self.comm_cycles = int(comm_us * _spin_cycles_per_us())
        # a pair of bf16 GEMMs (hidden -> cols -> hidden) reads 4 bytes per column and hidden dim
        cols = {k: max(8, v // (4 * HIDDEN) // scale) for k, v in per.items()}
        self.w_pre = torch.randn(hidden, cols["pre"], device=device, generator=g, dtype=dt) * hidden ** -0.5
        self.w_in = torch.randn(cols["pre"], hidden, device=device, generator=g, dtype=dt) * 1e-3
        self.w_post = torch.randn(hidden, cols["post"], device=device, generator=g, dtype=dt) * hidden ** -0.5
        self.w_out = torch.randn(cols["post"], hidden, device=device, generator=g, dtype=dt) * cols["post"] ** -0.5
        self.heads = ATTN_HEADS // scale // (GPUS if parallel == "tp" else 1)
        self.latent_dim = (LATENT + ROPE) // scale
        self.value_dim = LATENT // scale
        # the query and output projections' bytes are in w_pre / w_post; these small ones only carry the
        # data dependencies (a query per head from the layer's state, the heads' output back to it)
        self.w_q = torch.randn(hidden, self.latent_dim, device=device, generator=g, dtype=dt) * hidden ** -0.5
        self.q_heads = torch.randn(self.heads, self.latent_dim, device=device, generator=g, dtype=dt)
        self.w_o = torch.randn(self.value_dim, hidden, device=device, generator=g, dtype=dt) * 1e-2
        self.index_heads = INDEX_HEADS // scale
        self.wi_a = torch.randn(hidden, Q_LORA // scale, device=device, generator=g, dtype=dt) * hidden ** -0.5
        self.wi_b = torch.randn(Q_LORA // scale, self.index_heads * INDEX_DIM, device=device, generator=g,
                                dtype=dt) * (Q_LORA // scale) ** -0.5
        self.wi_w = torch.randn(hidden, self.index_heads, device=device, generator=g, dtype=dt) * hidden ** -0.5
        self.latent = torch.randn(batch * context, self.latent_dim, device=device, generator=g, dtype=dt)
        self.row0 = (torch.arange(batch, device=device) * context)[:, None]
        self.lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.topk = min(TOPK, context)
        self._index_state(g)
        self.x0 = torch.randn(batch, hidden, device=device, generator=g, dtype=dt)

    def _index_state(self, g) -> None:
        torch = self.torch
        from dsaindex.quant import fp8_quantize

        b, n = self.batch, self.context
        keys = torch.randn(b * n, INDEX_DIM, device=self.device, generator=g)
        fp8, scales = fp8_quantize(keys)
        fp8 = fp8.view(torch.uint8).reshape(b, n, INDEX_DIM)
        scales = scales.reshape(b, n)
        self.fp8, self.scales = fp8, scales
        if self.indexer == "torch":
            self.keys = (fp8.view(torch.float8_e4m3fn).float() * scales[..., None])
            return
        from dsaindex.kernels import deepgemm

        self.cache, self.table = deepgemm.paged_cache(fp8, scales)
        if self.indexer == "deepgemm":
            self.schedule = deepgemm.paged_schedule(self.lengths)
        elif self.indexer == "pq":
            from dsaindex.pq import PQCodec
            from dsaindex.runtime.paged_select import PagedCacheSelector

            m = 32
            codebooks = torch.randn(m, 256, INDEX_DIM // m, generator=torch.Generator().manual_seed(1)) * 0.5
            self.selector = PagedCacheSelector(PQCodec(codebooks), self.cache.shape[0], self.topk,
                                               device=self.device)
            codes = torch.randint(0, 256, (b * n // PAGE, PAGE, m), device=self.device, generator=g,
                                  dtype=torch.int32).to(torch.uint8)
            self.selector.adopt(self.cache, self.table.reshape(-1), codes)

    def select(self, x):
        """The indexer of one layer from its input ``x`` [B, hidden]: [B, topk] int64 key positions."""
        b = self.batch
        q = ((x @ self.wi_a) @ self.wi_b).reshape(b, self.index_heads, INDEX_DIM)
        w = (x @ self.wi_w).float() * (self.index_heads * INDEX_DIM) ** -0.5
        if self.indexer == "torch":  # the core's exact score of the dequantized keys, one query per request
            from dsaindex.score import batched_index_scores

            scores = batched_index_scores(q.float()[:, None], self.keys, w[:, None])[:, 0]  # [B, context]
            return scores.topk(self.topk, dim=1).indices
        if self.indexer == "pq":
            return self.selector.select(self.cache, self.table, self.lengths, q, w, eager_refresh=False).long()
        from dsaindex.kernels.topk import rows_topk

        if self.indexer == "deepgemm":
            from dsaindex.kernels import deepgemm

            logits = deepgemm.paged_logits(self.cache, self.table, self.lengths, q, w, self.context,
                                           self.schedule, masked=False)
        else:
            from dsaindex.kernels.fp8_score import fp8_logits_paged

            logits = fp8_logits_paged(self.cache, self.table, self.lengths, q, w)
        return rows_topk(logits, self.lengths, self.topk)[1]

    def attend(self, x, h, chosen):
        """Sparse absorbed-MLA attention of the layer's queries (from ``h``) over the ``chosen`` latent rows,
        then the output projection; ``x`` + the result."""
        torch = self.torch
        b = self.batch
        q = (h @ self.w_q)[:, None, :] + self.q_heads[None]  # [B, heads, latent + rope]
        kv = self.latent.index_select(0, (chosen.clamp_min(0) + self.row0).reshape(-1))
        kv = kv.reshape(b, -1, self.latent_dim)
        p = torch.softmax(torch.bmm(q, kv.transpose(1, 2)) * self.latent_dim ** -0.5, dim=-1)
        o = torch.bmm(p, kv[:, :, : self.value_dim])  # [B, heads, latent]
        return x + o.sum(1) @ self.w_o

    def step(self, kept: list[int], sources: list[int], lag: bool, trace: list | None = None):
        """One decode step through the stack: the ``kept`` layers run their indexer, layer ``l`` attends
        the selection of layer ``sources[l]``'s. With ``lag``, a kept layer's indexer (not the first
        layer's) runs on a side stream from the layer's input and is joined where it is first attended
        (or at the step's end). ``trace`` collects per layer (layer, source, its input, the selection it
        attends, its own or None), for tests. Returns the last hidden state."""
        torch = self.torch
        cuda = self.device.startswith("cuda")
        kept = set(kept)
        side = self.side if cuda and lag else None
        own: dict[int, object] = {}
        ready: dict[int, object] = {}
        x = self.x0
        for layer, src in enumerate(sources):
            if layer in kept and (src == layer or side is None):
                own[layer] = self.select(x)
            elif layer in kept:  # fork: the indexer runs under this layer's attention and feed-forward
                fork = torch.cuda.Event()
                fork.record()
                x.record_stream(side)  # read there after this stream has moved on
                with torch.cuda.stream(side):
                    side.wait_event(fork)
                    own[layer] = self.select(x)
                    done = torch.cuda.Event()
                    done.record(side)
                ready[layer] = done
            if src in ready:  # join where the selection is first attended
                torch.cuda.current_stream().wait_event(ready.pop(src))
            h = (x @ self.w_pre) @ self.w_in
            x_in = x
            x = self.attend(x, h, own[src])
            self._all_reduce()
            x = x + ((x @ self.w_post) @ self.w_out) * 1e-3
            self._all_reduce()
            if trace is not None:
                trace.append((layer, src, x_in, own[src], own.get(layer)))
        for done in ready.values():  # a selection no layer of this step attends: joined before the step ends
            torch.cuda.current_stream().wait_event(done)
        return x

    def _all_reduce(self) -> None:
        if self.comm_cycles:
            self.torch.cuda._sleep(self.comm_cycles)

    def timed_step(self, kept: list[int], sources: list[int], lag: bool) -> float:
        """Median ms of the step replayed from one CUDA graph."""
        from dsaindex.pipelines.bench.timing import graph_median_ms

        self.side = self.torch.cuda.Stream()
        return graph_median_ms(lambda: self.step(kept, sources, lag))


def _spin_cycles_per_us() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond on this GPU (measured)."""
    import torch

    from dsaindex.pipelines.bench.timing import event_median_ms

    cycles = 2_000_000
    # one untimed spin, then one timed queued behind it (its launch not counted)
    ms = event_median_ms(lambda: torch.cuda._sleep(cycles), repeats=1, warmup=1, idle_start=False)
    return cycles / (ms * 1e3)


def bench_decode_reuse(
    batches: str = typer.Option("1,32", help="Requests per GPU (comma-separated)."),
    context: int = typer.Option(131072, help="Keys per request (a multiple of 64)."),
    layers: int = typer.Option(16, help="Layers in the stack (retention 1/N keeps every N-th, from layer 0)."),
    retentions: str = typer.Option("1,2,4,8", help="N of the retentions 1/N to time."),
    indexer: str = typer.Option("auto", help="auto (deepgemm where it imports, else triton), deepgemm, triton or "
                                             "pq (the runtime's paged PQ step)."),
    parallel: str = typer.Option("tp", help="tp (8-way tensor parallel, the latency setup) or ep (data-parallel "
                                            "attention + 8-way expert parallel, the throughput setup)."),
    comm_us: float = typer.Option(15.0, help="Microseconds of each of a layer's two all-reduces under tp."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the table as markdown to this file."),
) -> None:
    """Decode-step time of a production-size synthetic stack under IndexCache alone and IndexCache + the
    Multi-layer Indexer's lag on a side stream, per retention, in CUDA graphs. Needs a CUDA device."""
    import torch

    from dsaindex.console import emit_report, parse_ints
    from dsaindex.errors import DsaIndexError
    from dsaindex.kernels import deepgemm

    if not torch.cuda.is_available():
        raise DsaIndexError("bench decode-reuse needs a CUDA device (streams, CUDA graphs).", "run it on a GPU machine.")
    if context % PAGE or context < TOPK:
        raise DsaIndexError(f"--context {context}: want a multiple of {PAGE} of at least {TOPK}.",
                            f"pass e.g. --context {max(TOPK, context // PAGE * PAGE)}.")
    ns = parse_ints(retentions, "--retentions", minimum=1)
    if parallel not in ("tp", "ep"):
        raise DsaIndexError(f"--parallel {parallel!r} is not tp or ep.", "pass --parallel tp or --parallel ep.")
    if indexer == "auto":
        indexer = "deepgemm" if deepgemm.unavailable() is None else "triton"
    if indexer not in ("deepgemm", "triton", "pq"):
        raise DsaIndexError(f"--indexer {indexer!r} is not one of auto, deepgemm, triton, pq.", "pick one of those.")
    if indexer == "deepgemm" and deepgemm.unavailable() is not None:
        raise DsaIndexError(f"--indexer deepgemm: DeepGEMM cannot run here ({deepgemm.unavailable()}).",
                            "pip install dsaindex[deepgemm], or pass --indexer triton.")
    rows = []
    for batch in parse_ints(batches, "--batches", minimum=1):
        stack = Stack(batch, context, indexer, parallel=parallel, comm_us=comm_us)
        times = {}
        for arm, n, kept, sources in arms(layers, ns):
            ms = stack.timed_step(kept, sources, lag=arm == "mli")
            times[(arm, n)] = ms
            rows.append({"batch": batch, "arm": arm, "retention": f"1/{n}", "kept": kept, "ms_per_step": round(ms, 4),
                         "tokens_per_s": round(batch * 1e3 / ms, 1)})
            typer.echo(str(rows[-1]), err=True)
        for r in rows:
            if r["batch"] != batch:
                continue
            n = int(r["retention"].split("/")[1])
            r["speedup_vs_all_indexers"] = round(times[("indexcache", 1)] / r["ms_per_step"], 4) \
                if ("indexcache", 1) in times else None
            r["mli_over_indexcache"] = round(times[("indexcache", n)] / times[("mli", n)], 4)
        del stack
        torch.cuda.empty_cache()
    targets = {}
    for batch in {r["batch"] for r in rows}:
        t = {(r["arm"], int(r["retention"].split("/")[1])): r["ms_per_step"] for r in rows if r["batch"] == batch}
        entry = {}
        if ("mli", 2) in t:
            entry["mli_over_indexcache_at_1/2"] = round(t[("indexcache", 2)] / t[("mli", 2)], 4)
        if ("mli", 4) in t and ("indexcache", 8) in t:
            entry["indexcache_1/8_over_mli_1/4"] = round(t[("indexcache", 8)] / t[("mli", 4)], 4)
        targets[str(batch)] = entry
    report = {"device": torch.cuda.get_device_name(), "indexer": indexer, "context": context, "layers": layers,
              "parallel": parallel, "comm_us": comm_us if parallel == "tp" else 0.0,
              "weight_bytes_per_layer": {str(b): weight_bytes(b, parallel) for b in {r["batch"] for r in rows}},
              "targets": targets, "rows": rows}
    emit_report(report, out, markdown, _table(rows))


def _table(rows: list[dict]) -> str:
    from dsaindex.console import markdown_rows

    head = ["B", "retention", "arm", "kept layers", "ms / step", "tokens/s", "vs every indexer", "MLI / IndexCache"]
    return markdown_rows(head, [[str(r["batch"]), r["retention"], r["arm"], str(len(r["kept"])),
                                 f"{r['ms_per_step']:.3f}", f"{r['tokens_per_s']:,.1f}",
                                 f"{r.get('speedup_vs_all_indexers') or math.nan:.3f}x",
                                 f"{r['mli_over_indexcache']:.3f}x"] for r in rows])
