"""Shared test helpers (importable: tests/ is on pytest's pythonpath)."""

import functools
import os
import subprocess
import sys

PRESETS = ("preset:tiny-v32", "preset:tiny-glm5", "preset:tiny-v4")


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
            isolated: bool = False) -> subprocess.CompletedProcess:
    """Run the command line ``dsaindex ARGS`` as a user would, and return its exit code and output.

    By default it runs in this process through the same ``main()`` that ``python -m dsaindex`` calls
    (stdout and stderr captured, the exit code taken from its ``SystemExit``), which spares each call a
    fresh interpreter's torch import. ``isolated=True``, an ``env``, or ``DSAINDEX_TEST_SUBPROCESS=1`` in
    the environment run it in a subprocess instead (``timeout`` applies there only). Commands run at the
    same time from several threads need ``isolated=True``: the in-process form swaps the process's
    ``sys.argv``, stdout and stderr."""
    if isolated or env or os.environ.get("DSAINDEX_TEST_SUBPROCESS") == "1":
        env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
        return subprocess.run(
            [sys.executable, "-m", "dsaindex", *args], capture_output=True, text=True, timeout=timeout, env=env
        )
    return _run_in_process(list(args))


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """``dsaindex ARGS`` as :func:`run_cli` runs it in this process, whatever ``DSAINDEX_TEST_SUBPROCESS``
    says: for a command run with part of the package patched, which a fresh interpreter would not see."""
    return _run_in_process(list(args))


def _run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    import contextlib
    import io
    import traceback
    import warnings

    from dsaindex.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv, code = sys.argv, 0
    sys.argv = ["dsaindex", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, int | None):
                    print(exc.code, file=sys.stderr)
            except Exception:  # an uncaught error: what the interpreter would print, and its exit code
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["dsaindex", *args], code, out.getvalue(), err.getvalue())


def text_corpus(root, files: int = 2, words: int = 600, seed: int = 1):
    """A folder ``root/corpus`` of ``files`` text files of ``words`` words each from a small vocabulary."""
    import numpy as np

    d = root / "corpus"
    d.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "indexer", "key", "query", "sparse", "attention", "\n"]
    for i in range(files):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(vocab, words)))
    return d


def model_index_keys(net, tokens, chunk_len: int = 512):
    """Every indexer layer's keys [N, D] of ``net`` (a V3.2-class transformers model) for ``tokens`` [N],
    as the indexer scores them, in the Hadamard basis: layer id -> float32 tensor. The tokens go through
    the KV cache ``chunk_len`` at a time (the same keys as one pass, as capture's chunks; the indexer's
    [chunk, heads, prefix] scores of a chunk stay small, where one pass of 3,000 tokens scores 3,000^2)."""
    import torch

    from dsaindex.hooks import ModuleHooks
    from dsaindex.indexer import cache_argument, mla_indexer_tensors
    from dsaindex.quant import to_basis

    keys: dict[int, list] = {}
    cache_kw = cache_argument(net.model)
    with ModuleHooks() as hooks, torch.no_grad():
        for i, layer in enumerate(net.model.layers):
            def grab(mod, a, i=i):
                cos, sin = a["position_embeddings"]
                k, _, _ = mla_indexer_tensors(mod, "half_split_head", a["hidden_states"], a["q_resid"], cos, sin)
                keys.setdefault(i, []).append(to_basis(k[0].float(), "hadamard"))
            hooks.register(layer.self_attn.indexer, pre=grab)
        cache = None
        for start in range(0, tokens.numel(), chunk_len):
            out = net.model(input_ids=tokens[start : start + chunk_len].unsqueeze(0), use_cache=True,
                            **{cache_kw: cache})
            cache = getattr(out, cache_kw) if cache_kw == "cache" else out.past_key_values
    return {i: torch.cat(chunks) for i, chunks in keys.items()}


def reference_bytes(skip: int, n: int):
    """``n`` bytes of a fixed Python source from ``skip`` on, as reference-checkpoint tokens (BOS 256 first)."""
    import inspect

    import torch

    data = inspect.getsource(inspect).encode()[skip : skip + n]
    return torch.tensor([256] + list(data), dtype=torch.long)


@functools.lru_cache(maxsize=1)
def reference_pq_codebooks() -> dict:
    """Plain PQ32 codebooks (8 torch Lloyd rounds) per layer of the reference checkpoint, trained on its
    index keys of 3,000 bytes of a text no test prompt reads: layer -> [32, 256, 4] float32 tensor. Computed
    once per test session (the 3,000-token forward is most of the cost) and shared by the runtime tests."""
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.pq import PQSpec
    from dsaindex.train.codebooks import train_codebooks

    net = load_model("reference-v1", dtype="float32").model
    keys = model_index_keys(net, reference_bytes(20_000, 3000))
    return {i: train_codebooks(k, PQSpec(dim=128, subspaces=32), "torch", 8) for i, k in keys.items()}


def exact_fp8_topk(keys_list, queries, head_weights, k: int):
    """Exhaustive FP8 top-k positions [B, k] of each request's keys (``keys_list``: one [n_b, D] tensor a
    request) for ``queries`` [B, H, D] and ``head_weights`` [B, H]: what every selection is judged against."""
    import torch

    from dsaindex.kernels.fp8_score import fp8_topk_reference
    from dsaindex.quant import fp8_quantize

    n, dim = max(x.shape[0] for x in keys_list), keys_list[0].shape[1]
    fp8 = torch.zeros(len(keys_list), n, dim, dtype=torch.uint8)
    scales = torch.zeros(len(keys_list), n)
    for i, x in enumerate(keys_list):
        codes, s = fp8_quantize(x.cpu())
        fp8[i, : x.shape[0]], scales[i, : x.shape[0]] = codes.view(torch.uint8), s.reshape(-1)
    lengths = torch.tensor([x.shape[0] for x in keys_list])
    return fp8_topk_reference(fp8, scales, lengths, queries.float().cpu(), head_weights.cpu(), k)[1]


def selection_overlap(a, b) -> float:
    """Share of ``b``'s selected positions (rows of [B, k]; -1 = none) that ``a`` also selected."""
    rows = [(set(x) - {-1}, set(y) - {-1}) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    return sum(len(x & y) for x, y in rows) / sum(len(y) for _, y in rows)


def v2_corpus(folder):
    """A corpus folder in the v2 reference checkpoint's tokens (what `dsaindex reference corpus` writes, in
    miniature): its tokenizer and two short documents per split."""
    import json
    import shutil

    from dsaindex.pipelines.capture.models import REFERENCE_DIR

    folder.mkdir()
    shutil.copy(REFERENCE_DIR / "tokenizer.json", folder / "tokenizer.json")
    for split, words in (("train", "alpha beta"), ("heldout", "It was a bright cold day in April")):
        docs = [{"source": "text", "title": str(i), "text": f"{words} {i}. " * 40} for i in range(2)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder


def serve(uris, model, served=None, name=None, device=None, **options):
    """:func:`dsaindex.runtime.serving.serve_index` with the settings given as flat keywords
    (:meth:`dsaindex.runtime.settings.ServeSettings.of`)."""
    from dsaindex.runtime.serving import serve_index
    from dsaindex.runtime.settings import ServeSettings

    return serve_index(uris, model, ServeSettings.of(**options), name=name, device=device, served=served)


def tiny_reference_model(seed: int = 0, topk: int = 8, **overrides):
    """A fresh tiny reference-geometry model (fp32) keeping ``topk`` keys (other config ``overrides`` too)."""
    from dsaindex.pipelines.capture.presets import TINY_REFERENCE_CONFIG, reference_config
    from dsaindex.pipelines.reference.forward import build_model

    config = reference_config(TINY_REFERENCE_CONFIG, index_topk=topk, **overrides)
    return build_model(config, seed=seed)


def peaked_main_attention(model, factor: float = 8.0) -> None:
    """Scale the main attention's query/key projections so its distribution is far from uniform
    (a fresh model attends almost uniformly, which leaves the indexer nothing to learn)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(factor)
            layer.self_attn.kv_b_proj.weight.mul_(factor)


def trained_looking_model(topk: int = 8, **overrides):
    """A tiny model whose main attention is peaked and whose indexer weights are spread (few score ties);
    ``topk`` and config ``overrides`` as :func:`tiny_reference_model`."""
    import torch

    from dsaindex.pipelines.reference.forward import indexer_parameters

    model = tiny_reference_model(topk=topk, **overrides).eval()
    peaked_main_attention(model)
    with torch.no_grad():
        for p in indexer_parameters(model):
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model


def tiny_reference_corpus(folder):
    """A corpus folder as `dsaindex reference corpus` writes it: documents, a BPE tokenizer (384 entries)."""
    import json

    from dsaindex.pipelines.capture.tokens import list_python_files
    from dsaindex.pipelines.reference.corpus import train_tokenizer

    folder.mkdir()
    files = [p for k, p in list_python_files() if k.startswith("stdlib/")][:60]
    docs = [{"source": "code", "title": p.name, "text": p.read_text(errors="replace")} for p in files]
    for name, part in (("train", docs[:50]), ("heldout", docs[50:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))
    train_tokenizer(lambda: (d["text"] for d in docs[:50]), 384, folder / "tokenizer.json")
    (folder / "corpus.json").write_text(json.dumps({"sources": []}))
    return folder
