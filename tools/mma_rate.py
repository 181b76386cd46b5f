"""Which warp-level tensor-core forms run at what rate on this card: ``mma.sync`` bf16 m16n8k16 (what the CUDA
stage 2 issues), e4m3 m16n8k32 and s8 m16n8k32 (the forms an 8-bit stage 2 would issue; an instruction the card
does not run natively is lowered by the compiler and runs no faster). Dense chains of independent ``mma`` on
register operands, CUDA-event medians of 5 launches; TFLOPS (TOPS for s8) and ``mma`` a microsecond a
multiprocessor. ``python3 tools/mma_rate.py [OUT.json]`` (a GPU; not part of the package)."""

import json
import sys

import torch

FORMS = {
    "bf16_m16n8k16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "f", 16),
    "e4m3_m16n8k32": ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32", "f", 32),
    "s8_m16n8k32": ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "r", 32),
}
TEMPLATE = r"""
extern "C" __global__ void rate(float* out, int iters) {
    unsigned a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x ^ 5u, threadIdx.x + 7u};
    unsigned b0 = threadIdx.x * 11u, b1 = threadIdx.x * 13u;
    ACC c[4][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int n = 0; n < 4; ++n)
            asm volatile("OP {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+C"(c[n][0]), "+C"(c[n][1]), "+C"(c[n][2]), "+C"(c[n][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    float s = 0.f;
    for (int n = 0; n < 4; ++n) s += (float)(c[n][0] + c[n][1] + c[n][2] + c[n][3]);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 4 * 256, device="cuda")
    iters, res = 4096, {"device": torch.cuda.get_device_name(0)}
    for form, (op, constraint, k) in FORMS.items():
        src = (TEMPLATE.replace("OP", op).replace("+C", f"+{constraint}")
               .replace("ACC", "float" if constraint == "f" else "int"))
        try:
            kernel = torch.cuda._compile_kernel(src, "rate")
        except RuntimeError as err:
            res[form] = f"did not compile: {err}"
            print(form, res[form], flush=True)
            continue
        for blocks in (2, 4):
            grid = (sms * blocks, 1, 1)
            kernel(grid=grid, block=(256, 1, 1), args=[out, iters])
            times = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                kernel(grid=grid, block=(256, 1, 1), args=[out, iters])
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            ms = sorted(times)[2]
            mmas = grid[0] * 8 * iters * 4  # 8 warps a block, 4 mma an iteration
            res[f"{form}_{blocks}_blocks"] = {"ms": round(ms, 4),
                                              "tflops": round(mmas * 16 * 8 * k * 2 / ms / 1e9, 1),
                                              "mma_per_us_per_sm": round(mmas / ms / 1e3 / sms, 1)}
            print(form, blocks, "blocks a multiprocessor:", res[f"{form}_{blocks}_blocks"], flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
