"""Models to capture from: built-in tiny presets, the reference checkpoint, or a local checkpoint.

Model references:

* ``preset:tiny-v32`` / ``preset:tiny-glm5`` / ``preset:tiny-v4``: small random-weight configs of the
  real transformers classes (fixed seed), for fast tests. Their indexers have production key dims
  (128) but few heads.
* ``preset:bench-v32``: random weights with the production V3.2 indexer (64 x 128, top-2048), to
  measure capture cost on a GPU. (Their configs live in :mod:`dsaindex.pipelines.capture.presets`.)
* ``reference``: the project's own trained DeepSeek-V3.2-class checkpoint, when it is present: v2
  (``reference_model_v2/``: BPE tokens, 32K context, long-range data), the default model;
  ``reference-v1``: its predecessor (``reference_model/``: byte tokens, 4K context).
* a local directory holding ``config.json`` and weights (``from_pretrained`` with no network).

Text is tokenized with the checkpoint's tokenizer where it ships one, else as UTF-8 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.fingerprint import ModelFingerprint, fingerprint_model
from dsaindex.errors import ModelNotFoundError
from dsaindex.pipelines.capture.presets import BOS_ID, EOS_ID, PRESETS, model_class, preset_config

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PRESETS",
    "REFERENCE_DIR",
    "REFERENCE_V1_DIR",
    "LoadedModel",
    "default_model_ref",
    "load_model",
    "preset_config",
    "quiet_transformers",
    "resolve_model_dir",
    "set_attention",
]

if TYPE_CHECKING:
    import torch

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference_model_v2"  # `reference`: v2, the default model
REFERENCE_V1_DIR = Path(__file__).resolve().parent.parent / "reference_model"  # `reference-v1`: byte tokens, 4K
REFERENCES = {"reference": REFERENCE_DIR, "reference-v1": REFERENCE_V1_DIR}


def default_model_ref() -> str:
    """The default model: the reference checkpoint (v2). Never a silent stand-in: an installation without it
    fails when the model loads, naming the fix (:func:`resolve_model_dir`)."""
    return "reference"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 = begin, 257 = end of document."""

    name = "bytes"
    bos_id, eos_id = BOS_ID, EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def for_transformers(self) -> Any:
        """The same tokenizer as a transformers ``PreTrainedTokenizerFast`` (what a transformers server
        takes): each byte its own token, the begin token first, decoding back to UTF-8 text."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        vocab |= {"<bos>": self.bos_id, "<eos>": self.eos_id}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


class HFTokenizer:
    """A checkpoint's own tokenizer, loaded from its directory."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.name = f"hf:{type(self.tok).__name__}"
        self.eos_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def for_transformers(self) -> Any:
        """The tokenizer a transformers server takes: this one, made to begin every text with the begin token
        where it declares one and does not add it itself (the reference checkpoints were trained on windows
        that begin with it)."""
        import copy

        tok, bos = self.tok, self.tok.bos_token
        if bos is None or self.tok.bos_token_id is None or tok("x")["input_ids"][:1] == [tok.bos_token_id]:
            return tok
        from tokenizers import processors

        tok = copy.deepcopy(tok)
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
        return tok


@dataclass
class LoadedModel:
    ref: str
    name: str
    model: Any
    tokenizer: Any
    fingerprint: ModelFingerprint  # what a capture records; compared with stores and bundles


def resolve_model_dir(ref: str) -> Path:
    if ref in REFERENCES:
        if not (REFERENCES[ref] / "config.json").is_file():
            raise ModelNotFoundError(
                f"The {ref} checkpoint (the default model) is not present in this installation "
                f"({REFERENCES[ref]}).",
                "reinstall dsaindex from a source tree or wheel that carries pipelines/reference_model_v2, or pass "
                "--model with a local checkpoint directory (or a preset such as preset:tiny-v32).",
            )
        return REFERENCES[ref]
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} has no config.json.", "point --model at a transformers checkpoint directory."
            )
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file, not a checkpoint directory.", "pass the checkpoint's folder.")
    looks_like_hub_id = ref.count("/") == 1 and not ref.startswith((".", "/", "~"))
    hint = (
        "this machine has no network: download the checkpoint elsewhere, copy it here and pass its directory"
        if looks_like_hub_id
        else "pass an existing checkpoint directory, `reference` (or `reference-v1`), or a preset such as "
        "`preset:tiny-v32`"
    )
    raise ModelNotFoundError(f"No local checkpoint at {ref!r}.", hint + ".")


def model_config(ref: str) -> Any:
    """The transformers config (object or ``config.json`` dict) of a model reference, without weights."""
    if ref.startswith("preset:"):
        return preset_config(ref.split(":", 1)[1])
    return json.loads((resolve_model_dir(ref) / "config.json").read_text())


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence what transformers prints while our own models load: its weight-loading progress bars,
    info/warning log lines and deprecation notices. Errors (log level ERROR, exceptions) still show."""
    import warnings

    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_model(ref: str, device: str = "cpu", dtype: str = "auto", seed: int = 0) -> LoadedModel:
    """Load a model reference (see module docstring) for capture: eval mode, on ``device``, without
    transformers' progress bars and deprecation notices (:func:`quiet_transformers`)."""
    with quiet_transformers():
        return _load_model(ref, device, dtype, seed)


def _load_model(ref: str, device: str, dtype: str, seed: int) -> LoadedModel:
    import torch

    from dsaindex.geometry import geometry_from_config

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if torch_dtype is None:
        raise ModelNotFoundError(f"Unknown dtype {dtype!r}.", "use auto, float32 or bfloat16.")

    if ref.startswith("preset:"):
        name = ref.split(":", 1)[1]
        config = preset_config(name)
        geometry = geometry_from_config(config)
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_class(geometry.family)(config)
        model = model.to(torch_dtype)
        tokenizer: Any = ByteTokenizer()
    else:
        path = resolve_model_dir(ref)
        raw = json.loads((path / "config.json").read_text())
        geometry_from_config(raw)  # refuses non-DSA models before any weights load
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch_dtype)
        model = model.to(device)
        name = ref if ref in REFERENCES else path.name
        has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        tokenizer = HFTokenizer(path) if has_tok else ByteTokenizer()
    model.eval()
    geometry = geometry_from_config(model.config)
    set_attention(model, geometry.family)
    return LoadedModel(
        ref=ref,
        name=name,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint_model(model, name),
    )


def set_attention(model: torch.nn.Module, family: str) -> None:
    """SDPA where it is exact; eager for V4, whose compressed-entry causality (``block_bias``) is only
    applied when the attention mask is a tensor: with SDPA and no mask, a single uncached pass lets
    queries see compressed entries of their own future (seen with transformers 5.24)."""
    impl = "eager" if family == "deepseek_v4" else "sdpa"
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl

