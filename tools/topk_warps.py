"""small_topk of k = 2,048 over [B, 4,416] rows (the paged step's final top-k) at 4-32 warps: CUDA-graph
medians per call, and whether each result is the exact top-k (a GPU; not part of the package)."""

import json

import torch

from dsaindex.kernels.topk import small_topk


def median_us(step, calls: int = 20, repeats: int = 15) -> float:
    """Median time of one ``step`` in microseconds, replayed from a CUDA graph of ``calls`` steps."""
    for _ in range(3):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def by_warps(values, k: int, payload, want: set, warps=(8, 16, 32), split_tail: bool | None = None,
             **row) -> list[dict]:
    """``small_topk`` of ``values`` at each of ``warps``: a row per launch (``row`` merged in) with its median us and
    whether row 0's payload is ``want``, printed as it comes. ``split_tail`` as small_topk's."""
    res = []
    for w in warps:
        def step(w=w):
            return small_topk(values, k, payload, num_warps=w, index_dtype=torch.int32, split_tail=split_tail)
        same = set(step()[1][0].tolist()) == want
        res.append(dict(row, num_warps=w, same=same, us=round(median_us(step), 1)))
        print(res[-1], flush=True)
    return res


def main() -> None:
    results = []
    for batch in (1, 8, 32):
        x = torch.randn(batch, 4416, device="cuda")
        payload = torch.arange(4416, device="cuda", dtype=torch.int32).expand(batch, -1).contiguous()
        results += by_warps(x, 2048, payload, set(x[0].topk(2048).indices.tolist()), (4, 8, 16, 32), batch=batch)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
