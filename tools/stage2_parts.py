"""Stage 2's CUDA kernel taken apart: the kernel as shipped, and with parts of its work removed by editing its
source (the codebook lookups, the ``mma``, the queries' ``ldmatrix``, the code loads, the int8 form's conversions),
launch tunings (loops unrolled, threads and blocks a multiprocessor, the int8 form's epilogue), and its int8 form
(``int8``, alone or with the others), at a grown C's shape: 32 requests x 1M keys, 96K candidates each (random
positions). CUDA-graph medians per launch, in us (a GPU; not part of the package).

``python3 tools/stage2_parts.py [VARIANTS] [OUT.json]``: VARIANTS a comma list of ``base`` or ``int8`` and
``+``-joined removals and tunings (default: ``base,int8,no_book+no_mma+no_ldsm``); ``@PATH`` in place of ``base``
or ``int8`` takes the kernel's source from a file (an earlier form, timed beside this one). With
``STAGE2_PARTS_ONCE=1`` each launch runs once, untimed, for a profiler: a variant's launches are 4,096 a block,
8,192, then 4,096 with the bins.
The table in docs/results.md ("Stage 2 as a CUDA kernel") came from it."""

import json
import os
import sys

import torch

from dsaindex.kernels import pq_stage2_cuda as s2
from dsaindex.pipelines.bench.timing import graph_median_ms

B, N, KEPT, SLOTS = 32, 1 << 20, 98304, 131072
# each removal: for each form of the kernel (bf16, int8: both are in the one source, under #ifdef), the text of
# its live branch and what replaces it, keeping the data dependencies alive; None where the form has no such part
REMOVALS = {
    "no_mma": {"bf16": ("for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[nt], a, kf[nt][step][0], kf[nt][step][1]);",
                        "for (int nt = 0; nt < 4; ++nt) { acc[nt][0] += __uint_as_float((kf[nt][step][0] ^ a[0]) & "
                        "0x3f800000u); acc[nt][1] += __uint_as_float((kf[nt][step][1] ^ a[1]) & 0x3f800000u); }"),
               "int8": ("for (int nt = 0; nt < 4; ++nt) mma_s8(iacc[nt], a, kf[nt][2 * step], kf[nt][2 * step + 1]);",
                        "for (int nt = 0; nt < 4; ++nt) { iacc[nt][0] += kf[nt][2 * step] ^ a[0]; "
                        "iacc[nt][1] += kf[nt][2 * step + 1] ^ a[1]; }")},
    "no_book": {"bf16": ("u[i] = book_s[code * 32 + ((first_sub + 4 * i) & 31)];", "u[i] = make_uint2(code, code + i);"),
                "int8": ("kf[nt][i] = book_s[code * 32 + first_sub + (i ^ (code & 7u))];",
                         "kf[nt][i] = code * 0x01010101u + i;")},
    "no_codes": {form: ("if (r_nxt[nt] >= 0) cur[nt] = __ldg(reinterpret_cast<const uint2*>(codes_b + (size_t)r_nxt[nt] "
                        "* 32));", "cur[nt] = make_uint2(r_nxt[nt], r_nxt[nt] * 3);") for form in ("bf16", "int8")},
    "no_ldsm": {"bf16": ("ldsm_x4(a, q_s + h * 64 + (((2 * step + (j >> 1)) ^ (h & 7)) << 2));",
                         "a[0] = step * 0x10001u + h; a[1] = a[0] + 1; a[2] = a[0] + 2; a[3] = a[0] + 3;"),
                "int8": ("ldsm_x4(a, q_s + h * 32 + (((2 * step + (j >> 1)) ^ (h & 7)) << 2));",
                         "a[0] = step * 0x10001u + h; a[1] = a[0] + 1; a[2] = a[0] + 2; a[3] = a[0] + 3;")},
    # the int8 form's accumulators taken as floats bit for bit: what converting them costs
    "no_cvt": {"bf16": None, "int8": ("acc[nt][e] = (float)iacc[nt][e];", "acc[nt][e] = __int_as_float(iacc[nt][e]);")},
}
# the int8 form's ReLU on the integers and the conversion by the exponent trick (|x| < 2^22: 127 x 127 x 128 is
# under it): two full-rate integer operations and a float add in place of the quarter-rate I2F and the float ReLU
EPILOGUE = "part[nt][0] += wa * fmaxf(acc[nt][0], 0.0f) + wb * fmaxf(acc[nt][2], 0.0f);\n" \
    "                part[nt][1] += wa * fmaxf(acc[nt][1], 0.0f) + wb * fmaxf(acc[nt][3], 0.0f);"
MAGIC = [("acc[nt][e] = (float)iacc[nt][e];",
          "acc[nt][e] = __int_as_float(max(iacc[nt][e], 0) + 0x4B400000) - 12582912.0f;"),
         (EPILOGUE, "part[nt][0] += wa * acc[nt][0] + wb * acc[nt][2];\n"
                    "                part[nt][1] += wa * acc[nt][1] + wb * acc[nt][3];")]
MT_LOOP = "#pragma unroll 1\n        for (int mt = 0; mt < 4; ++mt) {"
# launch variants, not removals: (text replaced, its replacement) pairs, #defines put before the source, threads
TUNINGS = {
    "unroll_mt": ([(MT_LOOP, MT_LOOP.replace("unroll 1", "unroll"))], "", None),
    "unroll_mt2": ([(MT_LOOP, MT_LOOP.replace("unroll 1", "unroll 2"))], "", None),
    "t512": ([], "#define THREADS 512\n#define MIN_BLOCKS 1\n", 512),
    "mb1": ([], "#define MIN_BLOCKS 1\n", None),
    "mb3": ([], "#define MIN_BLOCKS 3\n", None),  # the int8 form's 72 KB of shared memory fits 3 blocks
    "magic": (MAGIC, "", None),
}
INT8_ONLY = {"magic"}  # tunings whose texts sit in the int8 branch or would change the bf16 form's epilogue


def is_int8(src: str) -> bool:
    """Whether a kernel source is the int8 form (:func:`pq_stage2_cuda.source` with ``int8``)."""
    return "#define INT8" in src


def variant_source(name: str) -> tuple[str, int]:
    """The kernel's source with the removals and tunings ``name`` joins by ``+`` (``base``: as shipped; ``int8``:
    its form on 8-bit operands), and its threads a block."""
    parts = name.split("+")
    if parts[0].startswith("@"):  # a kernel source kept in a file (an earlier form, side by side)
        with open(parts[0][1:]) as f:
            src = f.read()
    else:
        src = s2.source("int8" in parts)
    prefix, threads = "", s2.THREADS
    for part in parts:
        if part in ("base", "int8") or part.startswith("@"):
            continue
        if part in TUNINGS:
            if part in INT8_ONLY and not is_int8(src):
                raise SystemExit(f"{part}: a tuning of the int8 form only")
            edits, defines, t = TUNINGS[part]
        elif part in REMOVALS:
            edit = REMOVALS[part]["int8" if is_int8(src) else "bf16"]
            if edit is None:
                raise SystemExit(f"{part}: not a part of this form of the kernel")
            edits, defines, t = [edit], "", None
        else:
            raise SystemExit(f"{part}: unknown; the removals: {', '.join(REMOVALS)}; the tunings: {', '.join(TUNINGS)}")
        for old, new in edits:
            if old not in src:
                raise SystemExit(f"{part}: the kernel's source no longer holds {old!r}; update tools/stage2_parts.py")
            src = src.replace(old, new)
        prefix += defines
        threads = t or threads
    return prefix + src, threads


def registers(kernel) -> int:
    """Registers a thread of a compiled kernel uses (the driver's CU_FUNC_ATTRIBUTE_NUM_REGS)."""
    import ctypes

    out = ctypes.c_int(0)
    ctypes.CDLL("libcuda.so.1").cuFuncGetAttribute(ctypes.byref(out), 4, kernel.func)
    return out.value


def main() -> None:
    names = (sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else "base,int8,no_book+no_mma+no_ldsm").split(",")
    once = os.environ.get("STAGE2_PARTS_ONCE") == "1"
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 256, (B, N, 32), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    rows = torch.randint(0, N, (B, SLOTS), device="cuda", generator=g, dtype=torch.int32)
    counts = torch.full((B,), KEPT, dtype=torch.int32, device="cuda")
    q = torch.randn(B, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(B, 64, device="cuda", generator=g) * 0.1
    cb = (torch.randn(32, 256, 4, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    out = torch.empty(B, SLOTS, dtype=torch.float32, device="cuda")
    bins = torch.empty(B, SLOTS, dtype=torch.int32, device="cuda")
    scratch = torch.zeros(B, s2.NBINS + 4, dtype=torch.int32, device="cuda")
    q8, w8, cb8, bounds = s2.int8_operands(q, w, cb, 1.0)
    res = {}
    for name in names:
        source, threads = variant_source(name)
        int8 = is_int8(source)
        operands = (cb8, q8, w8) if int8 else (cb, q, w)
        kernel = torch.cuda._compile_kernel(source, s2.KERNEL)
        kernel.set_shared_memory_config(s2.SHARED_BINS)
        res[f"{name}_registers"] = registers(kernel)
        print(name, res[f"{name}_registers"], "registers", flush=True)
        for per_block, with_bins in ((4096, False), (8192, False), (4096, True)):
            shared = (s2.SHARED_BINS8 if with_bins else s2.SHARED_SCORES8) if int8 else \
                (s2.SHARED_BINS if with_bins else s2.SHARED_SCORES)

            def call(k=kernel, pb=per_block, wb=with_bins, th=threads, sh=shared, ops=operands):
                k(grid=(-(-SLOTS // pb), B, 1), block=(th, 1, 1), shared_mem=sh,
                  args=[codes, rows, counts, *ops, out, bins, scratch, counts, 0, N, SLOTS, pb, 0, 1, int(wb), 1.0,
                        bounds])
            call()
            scratch.zero_()
            if once:  # a profiler's run: each launch once, untimed
                continue
            tag = f"{name}_{per_block}{'_bins' if with_bins else ''}"
            res[tag] = round(graph_median_ms(call) * 1000, 1)
            print(tag, res[tag], "us", flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
