"""Stage 1's CUDA scan taken apart: its selecting pass as shipped and with its loads (L1 or not, an L2 prefetch
hint, a warp's rows in two coalesced loads), prefetch depth, lookups or appends changed by editing its source, keys of 16 codes (``half``), each at several rows a block (a block builds its tables once for all its
rows), at B x 1M paged keys behind a shuffled page table, each request keeping about 6.25% of its rows (a grown
C's stage 1 at 1M keys). CUDA-graph medians per launch in us, beside a plain read of the same code bytes (the
floor), and whether each variant kept the same rows as the shipped kernel (a GPU; not part of the package).
``python3 tools/stage1_parts.py [VARIANTS] [OUT.json] [BATCHES]``: VARIANTS a comma list of ``base`` and
``+``-joined changes (default: every single change); BATCHES a comma list (default 1,8,32,64)."""

import json
import sys

import torch

from dsaindex.kernels import pq_scan_cuda as scan
from dsaindex.pipelines.bench.timing import graph_median_ms

N, SHARE = 1 << 20, 0.0625
BATCHES = (1, 8, 32, 64)
SPANS = (2048, 4096, 8192, 16384, 32768, 65536)  # rows a block: the shipped kernel at each
SPANS_CHANGED = (8192, 32768)  # a changed kernel at these only
LOOKUP = "score += *reinterpret_cast<const int*>(lut_bytes + at + 4 * (4 * k + j));"
LD_HINT = r"""
__device__ __forceinline__ uint4 ld_hint(const uint4* p) {
    uint4 v;
    asm("ld.global.cg.L2::HINT.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
#define LOAD ld_hint
"""
# each change: (#defines and helpers put before the source, (text replaced, its replacement) or None)
CHANGES = {
    "ldca": ("#define LOAD __ldca\n", None),  # through L1: a row's second 16 bytes hit the first's line
    "ldcs": ("#define LOAD __ldcs\n", None),
    "ldg": ("#define LOAD __ldg\n", None),
    "l2_256": (LD_HINT.replace("HINT", "256B"), None),
    "l2_128": (LD_HINT.replace("HINT", "128B"), None),
    "pf1": ("#define PREFETCH_ROWS 1\n", None),
    "coalesced": ("#define COALESCED 1\n", None),  # a warp's rows in two 512-byte loads, halves swapped by shuffles
    "no_lookup": ("", (LOOKUP, "score += (int)(at & 7u);")),  # the same reads and permutes, no shared loads
    "half": ("#define CODE_BYTES 16\n", None),  # keys of 16 codes (16 bytes a row, 16 lookups), its own codes
}


def code_bytes(name: str) -> int:
    """Code bytes a key the variant ``name`` reads."""
    return 16 if "half" in name.split("+") else 32


def variant_source(name: str, long_blocks: bool = False) -> str:
    """The scan's source with the changes ``name`` joins by ``+`` (``base``: as shipped), in its form for blocks of
    more than 8,192 rows where ``long_blocks``."""
    src, prefix = scan.source(long_blocks), ""
    for part in name.split("+"):
        if part == "base":
            continue
        if part not in CHANGES:
            raise SystemExit(f"{part}: unknown; want base or one of {', '.join(CHANGES)}")
        defines, edit = CHANGES[part]
        if edit is not None:
            if edit[0] not in src:
                raise SystemExit(f"{part}: the scan's source no longer holds {edit[0]!r}; update tools/stage1_parts.py")
            src = src.replace(*edit)
        prefix += defines
    return prefix + src


def sweep(b: int, kernels: dict) -> list[dict]:
    """The shipped kernel at every span of :data:`SPANS`, the changed ones at :data:`SPANS_CHANGED`, over ``b``
    requests of :data:`N` keys (of 32 codes; a variant of 16 codes reads its own, beside their plain read)."""
    res = []
    for m in sorted({code_bytes(name) for name in kernels}, reverse=True):
        res += sweep_codes(b, m, {name: forms for name, forms in kernels.items() if code_bytes(name) == m})
    return res


def sweep_codes(b: int, m: int, kernels: dict) -> list[dict]:
    """:func:`sweep` over keys of ``m`` codes."""
    g = torch.Generator(device="cuda").manual_seed(b)
    pages = b * N // 64
    table = torch.randperm(pages, device="cuda", generator=g).view(b, -1).int()
    codes = torch.randint(0, 256, (pages, 64, m), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    lut = torch.randint(-127, 128, (b, m, 256), device="cuda", generator=g, dtype=torch.int32).to(torch.int8)
    lengths = torch.full((b,), N, dtype=torch.int32, device="cuda")
    # each request's threshold: the (1 - SHARE) quantile of 65,536 sampled rows' integer sums
    sample = torch.randint(0, N, (b, 65536), device="cuda", generator=g)
    at = table.long()[torch.arange(b, device="cuda")[:, None], sample // 64] * 64 + sample % 64
    sums = lut.int().gather(2, codes.view(-1, m)[at].permute(0, 2, 1).long()).sum(1).float()
    thr = torch.quantile(sums, 1 - SHARE, dim=1).contiguous()
    none = torch.full_like(thr, float("inf"))
    cap = int(3 * SHARE * N)
    buf_p = torch.empty(b, cap, dtype=torch.int32, device="cuda")
    counts = torch.zeros(b, dtype=torch.int32, device="cuda")
    args = [codes, lengths, lut, thr, torch.empty(b, cap, dtype=torch.float32, device="cuda"), buf_p, counts, table,
            table.shape[1], N, cap, 0, 1]
    flat = codes.view(-1, 4).view(torch.int32)
    floor = graph_median_ms(lambda: flat.max()) * 1000
    res = [dict(batch=b, keys=N, variant=f"read (torch max over the codes, {m} bytes a key)", us=round(floor, 1))]
    print(res[-1], flush=True)
    kept = None
    for name, forms in kernels.items():
        for span in SPANS if name in ("base", "half") else SPANS_CHANGED:
            k = forms[span > scan.MAX_ROWS]
            for t, what in ((thr, ""), (none, ", no row kept")):
                lookups = "no_lookup" not in name.split("+")
                if (what and name not in ("base", "half", "no_lookup", "coalesced+no_lookup")) or (not what and not lookups):
                    continue  # with no row kept: the shipped kernel and the one without lookups only
                launch = args[:3] + [t] + args[4:11] + [span, 1]

                def call(k=k, span=span, launch=launch):
                    counts.zero_()
                    k(grid=(-(-N // span), b, 1), block=(scan.THREADS, 1, 1), shared_mem=scan.SHARED, args=launch)
                call()
                torch.cuda.synchronize()
                same = None
                if not what:
                    mine = [torch.sort(buf_p[i, : int(counts[i])]).values for i in range(b)]
                    same = kept is None or all(torch.equal(x, y) for x, y in zip(kept, mine, strict=True))
                    kept = kept or mine
                us = graph_median_ms(call) * 1000
                res.append(dict(batch=b, keys=N, variant=name + what, rows_a_block=span, us=round(us, 1),
                                vs_read=round(us / floor, 3), same_rows=same,
                                kept=int(counts.sum()) if not what else 0))
                print(res[-1], flush=True)
    return res


def main() -> None:
    default = "base," + ",".join(CHANGES) + ",coalesced+no_lookup,coalesced+pf1,coalesced+ldca"
    names = (sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else default).split(",")
    kernels = {}  # name -> (the kernel for blocks of up to 8,192 rows, the one for longer blocks)
    for name in names:
        kernels[name] = []
        for long_blocks in (False, True):
            k = torch.cuda._compile_kernel(variant_source(name, long_blocks), scan.KERNEL)
            k.set_shared_memory_config(scan.SHARED)
            kernels[name].append(k)
    res = []
    for b in [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else BATCHES:
        res += sweep(b, kernels)
        torch.cuda.empty_cache()
        if len(sys.argv) > 2:  # after each batch: a part that runs out of time still leaves its rows
            with open(sys.argv[2], "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
