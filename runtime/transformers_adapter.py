"""Engine adapter for transformers: the runtime chooses each layer's decode-time top-k.

:class:`RuntimeSelection` hooks every indexer of a V3.2 / GLM-5 transformers model. On every forward
it recomputes the indexer's keys, queries and head weights from the module's own weights
(:func:`dsaindex.indexer.mla_indexer_tensors`), rotates them into the artifacts' basis and appends
the keys to one :class:`PQDecodeGroup` per layer (a slot per batch row). On decode steps (one new
token) it replaces the indexer's top-k with the group's selection; prefill keeps the model's own.
It also records how many of the model's own top-k the runtime kept, per layer.

:func:`greedy_agreement` runs the comparison the runtime is judged by: the same prompt decoded
greedily with exhaustive selection and with the runtime, token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dsaindex.coarse import PREFILTER
from dsaindex.geometry import geometry_from_config
from dsaindex.hooks import ModuleHooks, PostHook, PreHook
from dsaindex.indexer import cache_argument, find_indexers, mla_indexer_tensors
from dsaindex.pq import PQCodec
from dsaindex.quant import to_basis
from dsaindex.runtime.host_store import HostKeyStore
from dsaindex.runtime.loader import per_layer
from dsaindex.runtime.pq_batch import PQDecodeGroup


@dataclass
class SelectionLog:
    """Per layer: decode steps seen and the mean share of the model's own top-k the runtime kept."""

    steps: dict[int, int] = field(default_factory=dict)
    kept: dict[int, float] = field(default_factory=dict)

    def recall(self) -> dict[int, float]:
        return {layer: self.kept[layer] / max(1, self.steps[layer]) for layer in self.steps}


class RuntimeSelection(ModuleHooks):
    """Context manager: decode-time top-k of ``model`` chosen by the runtime from ``layers``' PQ artifacts.

    Parameters
    ----------
    model : a transformers DSA model (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``)
    layers : layer id -> :class:`PQCodec` (``LoadedArtifacts.layers``), trained in ``basis``
    batch : rows of the generation batch; max_keys : longest sequence (prompt + new tokens)
    candidates, prefilter, stage1, exact_below : as :class:`PQDecodeGroup`, C, stage 1 and what it scores for
    every layer or a layer -> value mapping (``exact_below``: the length policy, off by default here, where the point is to measure
    PQ selection); cache_capacity : its cache rows (default twice the candidates, rounded up to its 4-row
    sets)
    """

    def __init__(self, model: torch.nn.Module, layers: dict[int, PQCodec], batch: int, max_keys: int,
                 basis: str = "hadamard", candidates: int | Mapping[int, int] = 1024,
                 prefilter: int | Mapping[int, int] = PREFILTER,
                 stage1: str | Mapping[int, str] = "codes",
                 cache_capacity: int | None = None, device: str | torch.device = "cpu",
                 use_triton: bool | None = None, exact_below: int = 0):
        super().__init__()
        self.model = model
        self.geometry = geometry_from_config(model.config)
        self.indexers = find_indexers(model, self.geometry)
        missing = sorted(set(self.indexers) - set(layers))
        if missing:
            from dsaindex.runtime.loader import ArtifactMismatchError

            raise ArtifactMismatchError(f"The artifacts have no layer {missing} of the model's indexer layers.",
                                        "train artifacts for every indexer layer of this model.")
        self.basis = basis
        pages = batch * (-(-max_keys // 64) + 1)
        c_of = per_layer(candidates, self.indexers, "candidate count C")
        p_of = per_layer(prefilter, self.indexers, "stage-1 prefilter")
        s_of = stage1 if isinstance(stage1, Mapping) else dict.fromkeys(self.indexers, stage1)
        self.groups = {
            layer: PQDecodeGroup(layers[layer], HostKeyStore(pages, self.geometry.head_dim), batch, max_keys,
                                 self.geometry.topk, candidates=c_of[layer], prefilter=p_of[layer],
                                 stage1=s_of.get(layer, "codes"), cache_capacity=cache_capacity or -(-2 * c_of[layer] // 4) * 4, device=device,
                                 use_triton=use_triton, exact_below=exact_below)
            for layer in self.indexers
        }
        for group in self.groups.values():
            for slot in range(batch):
                group.admit(slot)
        self.log = SelectionLog()
        self._chosen: dict[int, torch.Tensor] = {}

    def attach(self) -> None:
        for layer, module in self.indexers.items():
            self.register(module, pre=self._before(layer), post=self._after(layer))

    def remove(self) -> None:
        """Detach the hooks and free every request slot's pages."""
        super().remove()
        for group in self.groups.values():
            group.free_all()

    def _before(self, layer: int) -> PreHook:
        def hook(mod: torch.nn.Module, a: dict[str, Any]) -> None:
            cos, sin = a["position_embeddings"]
            last = torch.tensor([a["hidden_states"].shape[1] - 1], device=a["hidden_states"].device)
            with torch.no_grad():  # keys of every new token; the query only where the runtime selects
                keys, queries, weights = mla_indexer_tensors(
                    mod, self.geometry.rope_layout, a["hidden_states"], a["q_resid"], cos, sin, last)
            group = self.groups[layer]
            keys = to_basis(keys.float(), self.basis)
            for slot in range(keys.shape[0]):
                group.append(slot, keys[slot])
            if keys.shape[1] == 1:  # a decode step: the runtime selects
                picked, _ = group.select(to_basis(queries[:, -1].float(), self.basis), weights[:, -1])
                self._chosen[layer] = picked

        return hook

    def _after(self, layer: int) -> PostHook:
        def hook(mod: torch.nn.Module, output: torch.Tensor) -> torch.Tensor | None:
            picked = self._chosen.pop(layer, None)
            if picked is None:
                return None
            own = output[:, -1].long().to(picked.device)  # [B, k]: the model's exhaustive choice
            kept = sum(len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(picked.tolist(), own.tolist(), strict=True))
            self.log.steps[layer] = self.log.steps.get(layer, 0) + 1
            self.log.kept[layer] = self.log.kept.get(layer, 0.0) + kept / own.shape[0]
            # -1 (fewer keys than k) repeats the best position: the attention mask is the same
            filled = torch.where(picked >= 0, picked, picked[:, :1])
            return filled.to(output.device, torch.int32).unsqueeze(1)

        return hook


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, forced: torch.Tensor | None = None,
                  on_token: Callable[[int], None] | None = None, prefill_chunk: int | None = None) -> dict:
    """Greedy decoding with the KV cache. ``forced`` [new_tokens] feeds those tokens instead of the
    model's own (teacher forcing); the returned ``argmax`` [new_tokens] is the model's choice at each step.
    ``on_token(steps done)`` is called after the prompt (0) and after every decode step. ``prefill_chunk``
    feeds the prompt in chunks of that many tokens (a long prompt's prefill as a server runs it; the
    model's own indexer then scores each chunk against its prefix instead of the whole prompt at once)."""
    cache_kw = cache_argument(model)
    on_token = on_token or (lambda done: None)
    step = prefill_chunk or prompt.numel()
    cache = None
    for lo in range(0, prompt.numel(), step):
        kw = {} if cache is None else {cache_kw: cache}
        out = model(input_ids=prompt[lo : lo + step].unsqueeze(0), use_cache=True, **kw)
        cache = out.past_key_values
    choice = out.logits[0, -1].argmax()
    on_token(0)
    argmax, fed = [], []
    for step in range(new_tokens):
        argmax.append(int(choice))
        token = choice if forced is None else forced[step]
        fed.append(int(token))
        out = model(input_ids=token.view(1, 1), use_cache=True, **{cache_kw: cache})
        cache = out.past_key_values
        choice = out.logits[0, -1].argmax()
        on_token(step + 1)
    return {"argmax": torch.tensor(argmax), "fed": torch.tensor(fed)}


def byte_text(ids: list[int]) -> str:
    """The byte-level reference checkpoint's tokens as text (ids below 256 are UTF-8 bytes)."""
    return bytes(t for t in ids if t < 256).decode("utf-8", "replace")


def greedy_agreement(model: torch.nn.Module, layers: dict[int, PQCodec], prompt: torch.Tensor, new_tokens: int, basis: str = "hadamard",
                     candidates: int = 1024, prefilter: int = PREFILTER, stage1: str | Mapping[int, str] = "codes",
                     device: str = "cpu",
                     use_triton: bool | None = None, continuation: torch.Tensor | None = None, exact_below: int = 0,
                     progress: Callable[[int, int, str], None] | None = None,
                     selection: Callable[[], Any] | None = None, prefill_chunk: int | None = None,
                     decode: Callable[[list[int]], str] | None = None) -> dict:
    """Token agreement of runtime selection with exhaustive selection over ``new_tokens`` greedy steps.

    * ``free_running``: both decode on their own; share of equal tokens and the first divergence;
    * ``teacher_forced``: the runtime model is fed the exhaustive run's tokens; share of steps whose
      argmax equals the exhaustive argmax (no compounding after a first difference);
    * ``on_text`` (with ``continuation``, the real text after the prompt): both are fed that text, and
      the share of steps whose argmax agrees. Greedy decoding of a small model often settles into a
      loop that any selection reproduces; real text keeps every step informative;
    * ``selection_recall``: per layer, the share of the model's own top-k the runtime selected (on
      the real text when given, else on the exhaustive run's tokens);
    * ``index_bytes`` (a served index): its ``memory()`` after the teacher-forced run, the peak of the
      prefill indexes' device bytes among them.

    ``progress(tokens done, tokens in all, which run)`` is called after every generated token of the
    three (five with ``continuation``) runs. ``selection()``, if given, makes the runtime of each run
    instead of a decode-only :class:`RuntimeSelection` of ``layers`` (e.g. a fresh
    :class:`dsaindex.runtime.serving.ServedIndex`: IVF prefill and PQ decode, whose recall is then
    reported per phase); ``prefill_chunk`` as :func:`greedy_decode`. ``decode`` turns token ids into the
    reported texts (default: ids below 256 as UTF-8 bytes, the byte-level reference checkpoint's tokens).
    """
    decode = decode or byte_text
    prompt = prompt.to(device)
    text = continuation[:new_tokens].to(device) if continuation is not None else None
    runs = [("exhaustive", new_tokens), ("runtime, free running", new_tokens), ("runtime, teacher forced", new_tokens)]
    if text is not None:
        runs += [("exhaustive, real text", text.numel()), ("runtime, real text", text.numel())]
    before, total = {}, 0  # tokens of the runs before each run
    for name, n in runs:
        before[name], total = total, total + n

    def tick(name: str) -> Callable[[int], None] | None:
        return (lambda done: progress(before[name] + done, total, name)) if progress else None

    reference = greedy_decode(model, prompt, new_tokens, on_token=tick("exhaustive"), prefill_chunk=prefill_chunk)
    kwargs = dict(basis=basis, candidates=candidates, prefilter=prefilter, stage1=stage1, device=device,
                  use_triton=use_triton,
                  exact_below=exact_below)
    max_keys = prompt.numel() + new_tokens + 1
    runtime = selection or (lambda: RuntimeSelection(model, layers, 1, max_keys, **kwargs))
    with runtime():
        free = greedy_decode(model, prompt, new_tokens, on_token=tick("runtime, free running"),
                             prefill_chunk=prefill_chunk)
    with runtime() as forced_run:
        forced = greedy_decode(model, prompt, new_tokens, forced=reference["fed"].to(device),
                               on_token=tick("runtime, teacher forced"), prefill_chunk=prefill_chunk)
    recall_log = forced_run.log
    on_text = None
    if text is not None:
        exhaustive_text = greedy_decode(model, prompt, text.numel(), forced=text, on_token=tick("exhaustive, real text"),
                                        prefill_chunk=prefill_chunk)
        with runtime() as text_run:
            runtime_text = greedy_decode(model, prompt, text.numel(), forced=text, on_token=tick("runtime, real text"),
                                         prefill_chunk=prefill_chunk)
        recall_log = text_run.log
        on_text = {
            "token_agreement": round(float((runtime_text["argmax"] == exhaustive_text["argmax"]).float().mean()), 4),
            # argmax[i] is the prediction of text[i] (the prompt, then text[:i], came before it)
            "exhaustive_accuracy": round(float((exhaustive_text["argmax"] == text.cpu()).float().mean()), 4),
        }
    memory = forced_run.memory() if hasattr(forced_run, "memory") else None
    same = free["fed"] == reference["fed"]
    first = int((~same).nonzero()[0]) if (~same).any() else new_tokens
    distinct = len(set(reference["fed"].tolist()))
    return {
        "prompt_tokens": int(prompt.numel()),
        "new_tokens": new_tokens,
        "topk": int(geometry_from_config(model.config).topk),
        "candidates": candidates,
        "free_running": {"token_agreement": round(float(same.float().mean()), 4), "first_divergence": first},
        "teacher_forced": {"token_agreement": round(float((forced["argmax"] == reference["argmax"]).float().mean()), 4)},
        "on_text": on_text,
        "greedy_distinct_tokens": distinct,
        "selection_recall": _recall_report(recall_log.recall()),
        **({"index_bytes": memory} if memory is not None else {}),
        "reference_text": decode(reference["fed"].tolist()),
        "runtime_text": decode(free["fed"].tolist()),
    }


def _recall_report(recall: dict) -> dict:
    """Per layer (a decode-only runtime) or per phase and layer (a served index), string keys."""
    return {str(k): _recall_report(v) if isinstance(v, dict) else round(v, 4) for k, v in recall.items()}
