#!/usr/bin/env bash
# The decode step's GPU measurements in one run (a CUDA machine with dsaindex installed with its deepgemm extra,
# CUDA_HOME and DG_JIT_CACHE_DIR set): the GPU tests, tensor-core rates, stage 2's variants, the plugins' step at a
# fixed and a grown C with each stage 2 side by side, stage 1's scan taken apart and at longer blocks, the exact
# rescoring's and the final top-k's launches, the exact-path rule's grid, and a profile of the grown step at 32 x 1M;
# with a held-out STORE and an OPQ32/PQ32 BUNDLE, the served recall of the grown C with each CUDA stage 2.
# Every JSON and a log go to OUT. Usage: [PARTS=a,b,...] bash tools/decode_suite.sh OUT [SECONDS_A_PART [STORE BUNDLE]]
# PARTS picks parts by name (default: all; the whole suite runs far past ten minutes): rates stage2 stage1 gather
# topk span final radix operands encode stage2-small scan-small grown fixed rule profile recall tests
set -uo pipefail
OUT=${1:?usage: [PARTS=a,b,...] bash tools/decode_suite.sh OUT [SECONDS_A_PART [STORE BUNDLE]]}
LIMIT=${2:-240}
STORE=${3:-}
BUNDLE=${4:-}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
D="python3 -m dsaindex"
t0=$(date +%s)
PARTS=${PARTS:-all}
ALL="rates stage2 stage1 gather topk span final radix operands encode stage2-small scan-small grown fixed rule profile"
ALL="$ALL recall tests"
for p in ${PARTS//,/ }; do
    [ "$p" = all ] || [[ " $ALL " == *" $p "* ]] || { echo "decode_suite: no part '$p'; the parts: $ALL" >&2; exit 2; }
done
want() { [ "$PARTS" = all ] || [[ ",$PARTS," == *",$1,"* ]]; }
part() { echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
# beside SETUP NAME ARGS...: `bench paged ARGS` with SETUP (Python statements changing a module setting) run first, to
# OUT/NAME.json, then as shipped, to OUT/NAME_default.json
beside() {
    local setup=$1 name=$2
    shift 2
    timeout "$LIMIT" python3 -c "import sys; $setup; sys.argv[0] = 'dsaindex'; from dsaindex.cli import main; main()" \
        bench paged "$@" --out "$OUT/$name.json"
    timeout "$LIMIT" $D bench paged "$@" --out "$OUT/${name}_default.json"
}
common="--candidates 4096 --prefilter 4 --keys-on device"
# every part needs these: stop at once, not after minutes of parts that fail one by one (a zarr without its
# msgspec, a DeepGEMM without CUDA_HOME)
python3 -c "import dsaindex.artifacts.capture_store, deep_gemm, pytest, torch; assert torch.cuda.is_available()" \
    || { echo "decode_suite: the environment is not ready (above); nothing was run" >&2; exit 2; }
{
part "device"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if want rates; then
part "tensor-core rates"; timeout "$LIMIT" python3 tools/mma_rate.py "$OUT/mma_rate.json"
fi
if want stage2; then
part "stage 2 variants"
timeout "$LIMIT" python3 tools/stage2_parts.py base,int8,int8+mb3,int8+unroll_mt2,unroll_mt2,t512,no_book+no_mma+no_ldsm \
    "$OUT/stage2_parts.json"
fi
if want stage1; then
part "stage 1's scan taken apart: loads, coalesced reads, rows a block"
timeout "$LIMIT" python3 tools/stage1_parts.py "" "$OUT/stage1_parts.json"
fi
if want gather; then
part "the exact rescoring and the final top-k by launch"
timeout "$LIMIT" python3 tools/gather_sweep.py "$OUT/gather_sweep.json"
fi
if want topk; then
part "the final top-k taken apart: its k-th search, its load, a 16K-slot row"
(cd tools && timeout "$LIMIT" python3 topk_parts.py "$OUT/topk_parts.json")
fi
if want span; then
part "grown C, the scan's blocks at up to 64K rows against 8,192"
# the default caps a block at pq_scan_cuda.LAUNCH_ROWS rows; this run lifts the cap to MAX_SPAN, beside the default
timeout "$LIMIT" python3 -c "import sys, dsaindex.kernels.pq_scan_cuda as s; s.LAUNCH_ROWS = s.MAX_SPAN; \
sys.argv[0] = 'dsaindex'; from dsaindex.cli import main; main()" bench paged --batches 1,8,32,64 --keys 1048576 \
    $common --grow-band 131072 --out "$OUT/paged_grown_span_max.json"
fi
if want final; then
part "grown C, the final top-k in one program a row without a tail (as before), beside the default (radix_topk up to \
kernels.topk.RADIX_UP_TO_ROWS requests, then 16,384 slots + a tail)"
beside "import dsaindex.kernels.topk as t; t.RADIX_UP_TO_ROWS = 0; t.SPLIT_TAIL_FROM = 0" paged_grown_one_program \
    --batches 1,2,8,32,64 --keys 1048576 $common --grow-band 131072
fi
if want radix; then
part "grown C, the final top-k spread over programs up to 64 requests, beside the default"
beside "import dsaindex.kernels.topk as t; t.RADIX_UP_TO_ROWS = 64" paged_grown_radix_64 --batches 32,64 \
    --keys 1048576 $common --grow-band 131072 --exact-below 0
fi
if want operands; then
part "stage 2's operands at 4 warps (kernels.pq_stage2_cuda.OPERANDS_WARPS), beside the default 16: profiles"
beside "import dsaindex.kernels.pq_stage2_cuda as s; s.OPERANDS_WARPS = 4" profile_operands_4_warps \
    --batches 2,32 --keys 1048576 $common --grow-band 131072 --exact-below 0 --profile
fi
if want encode; then
part "the catch-up's encode at 8 warps (kernels.paged_codes.ENCODE_WARPS), beside the default 4: profiles"
beside "import dsaindex.kernels.paged_codes as c; c.ENCODE_WARPS = 8" profile_encode_8_warps \
    --batches 2,8,32 --keys 1048576 $common --grow-band 131072 --exact-below 0 --profile
fi
if want stage2-small; then
part "one or two requests' stage 2 on the CUDA kernel (kernels.pq_stage2_cuda.CUDA_FROM_SLOTS lowered), beside the \
default"
beside "import dsaindex.kernels.pq_stage2_cuda as s; s.CUDA_FROM_SLOTS = 1 << 16" paged_stage2_small_cuda \
    --batches 1,2 --keys 524288,1048576 $common --grow-band 131072 --exact-below 0 --profile
fi
if want scan-small; then
part "stage 1's scan in shorter blocks where few requests leave the GPU short of waves (kernels.pq_scan_cuda.MIN_ROWS \
4,096 and 2,048), and one request's stage 2 in blocks of 512 candidates (kernels.pq_stage2_cuda.block_size), beside the \
default"
beside "import dsaindex.kernels.pq_scan_cuda as s; s.MIN_ROWS = 4096" paged_scan_min_4096 --batches 1,2,8 \
    --keys 1048576 $common --grow-band 131072 --exact-below 0 --profile
timeout "$LIMIT" python3 -c "import sys, dsaindex.kernels.pq_scan_cuda as s; s.MIN_ROWS = 2048; \
sys.argv[0] = 'dsaindex'; from dsaindex.cli import main; main()" bench paged --batches 1,2,8 --keys 1048576 $common \
    --grow-band 131072 --exact-below 0 --profile --out "$OUT/paged_scan_min_2048.json"
timeout "$LIMIT" python3 -c "import sys, dsaindex.kernels.pq_stage2_cuda as s; s.block_size = lambda *a: 512; \
sys.argv[0] = 'dsaindex'; from dsaindex.cli import main; main()" bench paged --batches 1 --keys 1048576 $common \
    --grow-band 131072 --exact-below 0 --profile --out "$OUT/paged_stage2_block_512.json"
fi
if want grown; then
part "grown C, each stage 2"
timeout "$LIMIT" $D bench paged --batches 1,2,4,8,16,32,64 --keys 1048576 $common --grow-band 131072 \
    --stage2 auto,cuda,triton --out "$OUT/paged_grown.json"
fi
if want fixed; then
part "fixed C, each stage 2"
timeout "$LIMIT" $D bench paged --batches 1,2,8,32,64 --keys 1048576 $common --grow-band 0 --stage2 auto,cuda,triton \
    --out "$OUT/paged_fixed.json"
fi
if want rule; then
part "the exact-path rule: both paths at each step"
timeout "$LIMIT" $D bench paged --batches 1,2,4,8,16 --keys 524288,1048576 $common --grow-band 131072 \
    --exact-below 1099511627776 --out "$OUT/rule_grown_1m_512k.json"
timeout "$LIMIT" $D bench paged --batches 32,64 --keys 262144 $common --grow-band 131072 --exact-below 1099511627776 \
    --out "$OUT/rule_grown_256k.json"
fi
if want profile; then
part "profile, grown C at 32 x 1M"
timeout "$LIMIT" $D bench paged --batches 32 --keys 1048576 $common --grow-band 131072 --exact-below 0 --profile \
    --stage2 auto,cuda --out "$OUT/profile_grown_32x1m.json"
fi
if want recall; then
if [ -n "$STORE" ] && [ -n "$BUNDLE" ]; then
    for kernel in cuda int8; do
        part "served recall, grown C, stage 2 $kernel"
        timeout "$LIMIT" $D bench frontier --store "$STORE" --artifacts "$BUNDLE" --candidates 4096 --prefilter 4 \
            --no-timing --grow-band 131072 --stage2 "$kernel" --no-progress --out "$OUT/recall_grown_$kernel.json"
    done
fi
fi
if want tests; then
part "GPU tests"
timeout "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider
# the kernels' files whole, CPU tests included: on a GPU they meet its atomics' orders and parallel programs, which the
# interpreter never shows (a decode-plan check that counted the kernel's fetches against the reference's rows failed on
# the H100 only; test_decode_plan_checks_hold_in_any_atomic_order now shows it on the CPU too)
timeout "$LIMIT" python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernel_select.py tests/test_kernel_topk.py \
    tests/test_paged_select.py
fi
part "done"
} 2>&1 | tee "$OUT/log.txt"
