"""Registers and spills of every Triton kernel the plugins' decode step launches, known on a machine without a GPU.

The step runs once on the CPU through the Triton interpreter at the serving geometry: 64 heads of 128 dimensions,
PQ32, C = 4,096, stage 1 at 4 x C, C grown past ``GROW`` keys. Every launch is recorded
(``triton_resources.Launches``). Then each is compiled for sm_90 in a process without the interpreter, at its own
signature, constexprs and warps. On a CPU the stages that a GPU runs as CUDA kernels (stage 1's scan, stage 2)
run their Triton forms, so those are in the list too.

``python3 tools/step_launches.py OUT.json [B [KEYS [GROW]]]`` (defaults 2, 131072, 8192). Put another Triton first
on the path to compile with it (``PYTHONPATH=DIR``; the recording uses this environment's)."""

import json
import os
import subprocess
import sys
import tempfile


def record(batch: int, keys: int, grow: int) -> list[dict]:
    """The launches of one step of ``batch`` requests of ``keys`` keys (run under TRITON_INTERPRET=1)."""
    import torch
    from triton_resources import Launches

    from dsaindex.kernels import deepgemm
    from dsaindex.pipelines.bench.decode import synthetic_state
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.paged_select import PagedCacheSelector

    fp8, scales, codes, codebooks, q, w = synthetic_state(batch, keys, 64, 32, device="cpu")
    cache, table = deepgemm.paged_cache(fp8, scales)
    lengths = torch.full((batch,), keys, dtype=torch.int32)
    selector = PagedCacheSelector(PQCodec(codebooks.float()), cache.shape[0], 2048, candidates=4096, prefilter=4,
                                  device="cpu", exact_below=0, grow_band=grow, use_triton=True)
    selector.adopt(cache, table.reshape(-1), codes.reshape(-1, 64, codes.shape[2]))
    with Launches() as seen:
        selector.select(cache, table, lengths, q, w, eager_refresh=False)
    return seen.rows


def main() -> None:
    out = sys.argv[1]
    batch, keys, grow = (int(a) for a in (sys.argv[2:] + ["2", "131072", "8192"][len(sys.argv) - 2:])[:3])
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("TRITON_INTERPRET") != "1":  # record in an interpreting child, compile here
        env = dict(os.environ, TRITON_INTERPRET="1")
        env.pop("PYTHONPATH", None)  # the recording runs on this environment's own Triton
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "launches.json")
            subprocess.run([sys.executable, __file__, log, str(batch), str(keys), str(grow)], env=env, check=True)
            with open(log) as f:
                rows = json.load(f)
        sys.path.insert(0, here)
        from triton_resources import compile_rows

        with open(out, "w") as f:
            json.dump(dict(batch=batch, keys=keys, grow_band=grow, launches=compile_rows(rows)), f, indent=1)
        return
    sys.path.insert(0, here)
    rows = record(batch, keys, grow)
    print(f"{len(rows)} distinct launches recorded", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
