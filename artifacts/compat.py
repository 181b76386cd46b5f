"""Does this belong to that? The one set of rules for capture stores, bundles and served models.

* :func:`check_store_for_model`: a capture store was captured from the model a training targets;
* :func:`check_store_for_bundle`: a store may evaluate a bundle (same model, same key basis);
* :func:`check_bundle_for_model`: a bundle may serve a model (what the runtime loader runs at startup).

"Same model" is one rule everywhere: :meth:`ModelFingerprint.same_model` (family, architecture and
indexer-weights digest; the architecture by config digest, or field by field where two transformers
releases describe one model differently). Every refusal names both sides, the field that differs and the fix. The digests are
computed in one place, :mod:`dsaindex.artifacts.fingerprint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.fingerprint import (
    ModelFingerprint,
    config_digest,
    config_field_differences,
    config_fields,
    configs_agree,
    configs_match,
)
from dsaindex.errors import ArtifactMismatchError, StoreMismatchError, differences

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest
    from dsaindex.artifacts.capture_store import CaptureManifest

SUPPORTED_SCHEMA_VERSIONS = (1,)
def _model_differences(have: ModelFingerprint, want: ModelFingerprint, left: str, right: str) -> str:
    keys = ["family", "weights_digest"] + ([] if configs_agree(have, want) else ["config_digest"])
    found = differences({k: getattr(have, k) for k in keys}, {k: getattr(want, k) for k in keys}, left, right)
    return found + _field_note(have.config_fields, want.config_fields, left, right)


def _field_note(have: dict | None, want: dict | None, left: str, right: str) -> str:
    """The architecture fields behind a config-digest difference, where both sides record them."""
    if have is None or want is None:
        return ""
    fields = config_field_differences(have, want)
    if not fields:
        return ""
    return " (config fields " + differences({k: a for k, (a, _) in fields.items()},
                                           {k: b for k, (_, b) in fields.items()}, left, right) + ")"


def check_store_for_model(store_model: ModelFingerprint, model: ModelFingerprint, store: str, model_ref: str) -> None:
    """Refuse a store captured from another model than ``model`` (the target of a training)."""
    if not store_model.same_model(model):
        raise StoreMismatchError(
            f"{store} was captured from {store_model.describe()}, not from {model_ref} ({model.describe()}): "
            f"{_model_differences(store_model, model, 'store', 'model')}.",
            f"capture from {model_ref} first (`dsaindex capture NEW_STORE --model {model_ref}`), or train for "
            f"the store's own model.",
        )


def check_store_for_bundle(store_manifest: CaptureManifest, bundle_manifest: BundleManifest, store: str,
                           bundle: str) -> None:
    """Refuse to evaluate a bundle on a store of another model or key basis (the store's held-out keys
    would not be the keys the bundle was trained for)."""
    have, want = store_manifest.model, bundle_manifest.model
    if not have.same_model(want):
        raise StoreMismatchError(
            f"{bundle} was trained for {want.describe()} but {store} holds {have.describe()}: "
            f"{_model_differences(have, want, 'store', 'bundle')}.",
            "evaluate on a store captured from the bundle's model (`dsaindex registry show` names it).",
        )
    if store_manifest.settings.basis != bundle_manifest.basis:
        raise StoreMismatchError(
            f"{bundle} was trained on keys in the {bundle_manifest.basis} basis but {store} holds the "
            f"{store_manifest.settings.basis} basis.",
            f"capture a store with --basis {bundle_manifest.basis} to evaluate this bundle.",
        )


def check_bundle_for_model(manifest: BundleManifest, model_config: Any, basis: str = "hadamard",
                           served: ModelFingerprint | None = None, allow_other_weights: bool = False) -> None:
    """Refuse artifacts that do not fit the served model (given by its transformers config, object or
    dict), naming both sides and the fix.

    Checks the schema version, the family, the indexer geometry (heads, head dim, key stride), the key
    format and the key basis the engine scores in, that the bundle covers exactly the model's indexer
    layers, that every layer's kind is one this dsaindex can serve, and then that it is the model the
    artifacts were trained for (:func:`check_same_model`): with ``served`` (the served model's
    fingerprint) its config and indexer-weights digests, else the config digest computed from
    ``model_config`` where that is possible. ``allow_other_weights`` skips that last check (a deliberate
    transfer to another model of the same geometry).
    """
    from dsaindex.artifacts.kinds import KINDS
    from dsaindex.geometry import geometry_from_config

    fix_retrain = "train artifacts for this model (`dsaindex capture` from it, then `dsaindex train pq`)"
    if manifest.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactMismatchError(
            f"Bundle schema version {manifest.schema_version} is not supported by this runtime "
            f"(supports {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}).",
            "upgrade dsaindex on the server, or retrain the artifacts with the server's dsaindex version.",
        )
    geometry = geometry_from_config(model_config)
    trained = manifest.model.geometry
    checks = [
        ("family", manifest.model.family, geometry.family),
        ("indexer head dim", trained.head_dim, geometry.head_dim),
        ("indexer heads", trained.n_heads, geometry.n_heads),
        ("key stride", trained.key_stride, geometry.key_stride),
        ("key format", manifest.key_format, geometry.key_format),
        ("key basis", manifest.basis, basis),
    ]
    for what, theirs, ours in checks:
        if theirs != ours:
            raise ArtifactMismatchError(
                f"The artifacts' {what} is {theirs!r} (trained for {manifest.model.name}) but the served model's "
                f"is {ours!r}.",
                fix_retrain + ("" if what != "key basis" else f", or serve with basis={theirs!r}") + ".",
            )
    have = sorted(int(i) for i in manifest.layers)
    want = list(geometry.indexer_layers)
    if have != want:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        raise ArtifactMismatchError(
            f"The artifacts cover indexer layers {have} but the served model's indexer layers are {want}"
            + (f" (missing {missing})" if missing else "") + (f" (not in the model: {extra})" if extra else "") + ".",
            fix_retrain + ".",
        )
    for layer_id, layer in manifest.layers.items():
        if layer.kind not in KINDS:
            raise ArtifactMismatchError(
                f"Layer {layer_id} holds a {layer.kind!r} artifact; this runtime loads {', '.join(sorted(KINDS))}.",
                "upgrade dsaindex on the server.",
            )
    if not allow_other_weights:
        check_same_model(manifest.model, served, model_config)


def check_same_model(trained: ModelFingerprint, served: ModelFingerprint | None, model_config: Any = None) -> None:
    """Refuse to serve artifacts trained for ``trained`` on another model: the config digest and the
    indexer-weights digest of ``served`` must equal the bundle's (two checkpoints of one architecture
    produce other keys, so codebooks and encoders do not transfer). Configs whose digests differ still
    match when every field both record agrees (two transformers releases; bundles written before fields
    were recorded match by digest only). Without ``served`` only ``model_config`` is compared (when
    :func:`config_digest` can compute it)."""
    if served is not None:
        digest, fields, who = served.config_digest, served.config_fields, served.describe()
    else:
        digest = config_digest(model_config) if model_config is not None else None
        if digest is None:
            return
        fields, who = config_fields(model_config), "the served model (config only)"
    have, want = {}, {}
    if served is not None and served.weights_digest != trained.weights_digest:
        have["weights_digest"], want["weights_digest"] = served.weights_digest, trained.weights_digest
    same_config = configs_match(trained.config_digest, trained.config_fields, digest, fields)
    if not same_config:
        have["config_digest"], want["config_digest"] = digest, trained.config_digest
    if have:
        raise ArtifactMismatchError(
            f"The artifacts were trained for {trained.describe()} but the served model is {who}: "
            f"{differences(want, have, 'artifacts', 'served')}"
            f"{'' if same_config else _field_note(trained.config_fields, fields, 'artifacts', 'served')}.",
            "train artifacts for this model (`dsaindex capture STORE --model M`, then `dsaindex train pq STORE "
            "--model M`), or pass --allow-other-weights (allow_other_weights=True) to serve them on other "
            "weights deliberately (measure recall there first).",
        )
