"""The registers, stack (spills) and shared memory of Triton kernels compiled for a CUDA GPU, on a machine without
one: Triton's own ptxas compiles for the target and its cuobjdump reads the cubin. What a kernel change does to
register pressure is known before any device time is spent.

``python3 tools/triton_resources.py [OUT.json]`` prints the decode step's final top-k and stage 2's operands at
their launch shapes for sm_90. The numbers are this Triton's; a GPU running another Triton differs: put that
Triton first on the path (``pip install --target DIR --no-deps triton==X`` and ``PYTHONPATH=DIR``).
``python3 tools/triton_resources.py --compile LAUNCHES.json OUT.json`` compiles the launches a run recorded in the
interpreter (:class:`Launches`) at their own signatures and constexprs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings


def tool(name: str) -> str | None:
    """Path of a binary Triton ships for its CUDA backend (ptxas, cuobjdump), or None where it has none."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def resources(fn, signature: dict, constexprs: dict, num_warps: int, arch: int = 90) -> dict:
    """Compile the ``@triton.jit`` function ``fn`` for sm_``arch`` (``signature``: argument -> Triton type such as
    ``*fp32`` / ``i32``; ``constexprs``: their values) and return its registers, stack bytes, static and dynamic
    shared memory. Raises ``RuntimeError`` where this Triton has no cuobjdump."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("this Triton ships no cuobjdump (its CUDA backend's binaries): nothing can read a cubin")
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "local_bytes": int(fields["LOCAL"]),
            "static_shared": int(fields["SHARED"]), "dynamic_shared": int(kernel.metadata.shared),
            "num_warps": num_warps, "triton": triton.__version__, "arch": f"sm_{arch}"}


TOPK_ROW = {"val_ptr": "*fp32", "pay_ptr": "*i32", "out_val_ptr": "*fp32", "out_pay_ptr": "*i32", "count_ptr": "*i32",
            "n": "i32", "k": "i32"}
RADIX_DIGIT = {"val_ptr": "*fp32", "count_ptr": "*i32", "scratch_ptr": "*i64", "n": "i32", "k": "i32"}
RADIX_TAKE = {"val_ptr": "*fp32", "count_ptr": "*i32", "scratch_ptr": "*i64", "pay_ptr": "*i32", "out_val_ptr": "*fp32",
              "out_pay_ptr": "*i32", "n": "i32", "k": "i32"}


OPERANDS = {"q_ptr": "*bf16", "w_ptr": "*fp32", "scale_ptr": "*fp32", "q8_ptr": "*i8", "w8_ptr": "*fp32",
            "bound_ptr": "*fp32", "key_bound": "fp32"}


def topk_kernels(k: int = 2048) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, warps) of the step's final top-k as small_topk and radix_topk launch
    it for a grown C's 16,704-slot row and a fixed C's 4,416-slot one, and of stage 2's int8 operands (a request's
    64 x 128 queries) at 4 and 16 warps."""
    from dsaindex.kernels.pq_stage2_kernel import int8_operands_kernel
    from dsaindex.kernels.topk import RADIX_BLOCK, radix_scratch_words, row_warps, split_tail_block
    from dsaindex.kernels.topk_kernel import radix_digit_kernel, radix_take_kernel, row_topk_kernel

    out = [(f"int8_operands at {w} warps", int8_operands_kernel, OPERANDS, dict(H=64, D=128, DSUB=4), w)
           for w in (4, 16)]
    for n in (16704, 4416):
        for split in (False, True):
            block, tail = split_tail_block(n) if split else (1 << (n - 1).bit_length(), 0)
            c = dict(BLOCK=block, K_BLOCK=k, HAS_PAYLOAD=True, HAS_COUNTS=False, WIDTH=128, CHUNK=4096, TAIL=tail)
            out.append((f"small_topk {n} as {block}" + (f" + {tail}" if tail else ""), row_topk_kernel, TOPK_ROW, c,
                        row_warps(block, tail)))
    for bits, passes in ((11, 3), (8, 4)):
        for p in range(passes):
            c = dict(PASS=p, WIDE=bits == 11, BLOCK=RADIX_BLOCK, HAS_COUNTS=False, SCRATCH=radix_scratch_words(bits))
            out.append((f"radix_topk digit {p} of {bits} bits", radix_digit_kernel, RADIX_DIGIT, c, 4))
    c = dict(BLOCK=RADIX_BLOCK, K_BLOCK=k, HAS_COUNTS=False, HAS_PAYLOAD=True, SCRATCH=radix_scratch_words(8),
             WIDE=False, SCRATCH_PAD=1024)
    out.append(("radix_topk take", radix_take_kernel, RADIX_TAKE, c, 4))
    return out


TORCH_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int8": "i8",
               "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
               "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def triton_type(value) -> str:
    """The Triton signature type of a launch argument: a tensor's pointer type, an int's width, a float."""
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        return "*" + TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of {type(value).__name__}")


class Launches:
    """Every kernel launch made under ``with Launches() as seen:`` in the Triton interpreter (TRITON_INTERPRET=1),
    once per distinct (kernel, signature, constexprs, warps): ``seen.rows``, JSON-ready for :func:`compile_rows`.
    A constexpr ``F32`` is recorded as a GPU launch sets it (False: the kernels' float32 dots are the
    interpreter's)."""

    def __enter__(self):
        import inspect

        from triton.runtime import interpreter

        self.rows, self._keys = [], set()
        self._executor = interpreter.GridExecutor
        original = self._original = interpreter.GridExecutor.__call__
        rows, keys = self.rows, self._keys

        def call(executor, *args, **kwargs):
            params = inspect.signature(executor.fn).parameters
            bound = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
            bound.update(zip(params, args, strict=False))  # the rest by keyword or default
            bound.update((k, v) for k, v in kwargs.items() if k in params)
            sig, consts = {}, {}
            for name in params:
                value = bound.get(name)
                if name == "F32" and value is True:  # float32 dots: what the kernels take only when interpreted
                    value = False
                if name in executor.constexprs or value is None:
                    consts[name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
                else:
                    sig[name] = triton_type(value)
            row = dict(module=executor.fn.__module__, kernel=executor.fn.__name__, signature=sig, constexprs=consts,
                       num_warps=int(kwargs.get("num_warps", 4)))
            key = json.dumps(row, sort_keys=True)
            if key not in keys:
                keys.add(key)
                rows.append(row)
            return original(executor, *args, **kwargs)

        interpreter.GridExecutor.__call__ = call
        return self

    def __exit__(self, *exc):
        self._executor.__call__ = self._original
        return False


def compile_rows(rows: list[dict], arch: int = 90) -> list[dict]:
    """:func:`resources` of each recorded launch (:class:`Launches`), compiled, not interpreted: run it in a process
    without TRITON_INTERPRET. A launch that does not compile gets its error instead."""
    import importlib

    out = []
    for row in rows:
        fn = getattr(importlib.import_module(row["module"]), row["kernel"])
        try:
            res = resources(fn, row["signature"], row["constexprs"], row["num_warps"], arch)
        except Exception as e:  # noqa: BLE001 - reported per launch, the others still compile
            res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out.append(dict(kernel=row["kernel"], module=row["module"], signature=row["signature"],
                        constexprs=row["constexprs"], **res))
        print(out[-1], flush=True)
    return out


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--compile"]:  # LAUNCHES.json (rows of Launches) OUT.json
        with open(args[1]) as f:
            rows = compile_rows(json.load(f))
        with open(args[2], "w") as f:
            json.dump(rows, f, indent=1)
        return
    rows = []
    for name, fn, sig, consts, warps in topk_kernels():
        rows.append(dict(kernel=name, **resources(fn, sig, consts, warps)))
        print(rows[-1], flush=True)
    if args:
        with open(args[0], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
