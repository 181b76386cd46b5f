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


def main() -> None:
    results = {}
    for batch in (1, 8, 32):
        x = torch.randn(batch, 4416, device="cuda")
        payload = torch.arange(4416, device="cuda").expand(batch, -1).contiguous()
        want = set(x[0].topk(2048).indices.tolist())
        for warps in (4, 8, 16, 32):
            def step(x=x, payload=payload, warps=warps):
                return small_topk(x, 2048, payload, num_warps=warps)

            exact = set(step()[1][0].tolist()) == want
            results[f"B{batch}_w{warps}"] = {"us": round(median_us(step), 2), "exact": exact}
            print(batch, warps, results[f"B{batch}_w{warps}"], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
