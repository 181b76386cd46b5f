"""MLflow 3 tracking and registry of artifact bundles.

A training is an MLflow *run* (its params, metrics, plots and the bundle manifest as artifacts). The
bundle itself is a *LoggedModel* of that run, whose artifacts are the bundle folder; it is registered as
a new version of one registered model per target model (:func:`registered_name`) and gets the alias
``candidate``; :func:`promote` moves ``production`` (or any alias) onto a version.

Where things live: ``--tracking-uri`` > ``MLFLOW_TRACKING_URI`` > ``sqlite:///<cwd>/runs/mlflow/mlflow.db``.
For a sqlite store, artifacts are kept beside the database (``<db folder>/artifacts``); a team points
``MLFLOW_TRACKING_URI`` at a tracking server and lets the server place artifacts (e.g. on S3).

Registration is all or nothing. A new version carries the tag ``dsaindex.registering`` (when it started,
which version was ``@candidate`` before) until the last step removes it; nothing resolves to, lists or
counts a version with that tag. If a step fails, the version is deleted, the logged model and run are
marked failed and a :class:`DsaIndexError` is raised. If the process dies instead (kill -9, power), the
next registry command of any process undoes what it left: it deletes the version, moves ``@candidate``
back, marks the run and its logged models failed. On sqlite, one registration at a time holds a file
lock beside the database for its whole length, so a command that takes the lock knows every unfinished
registration it finds is dead; on a tracking server (no lock) those whose process was on this machine and
is gone, and others once older than :data:`STALE_VERSION_S` (a version) or :data:`STALE_RUN_S` (a run
without one) are undone. Registering a
bundle whose ``bundle_id`` is already registered returns that version.

Tracking servers (``http(s)://``) are first asked one cheap question with a short timeout, so an
unreachable server fails in seconds with its URI in the message; MLflow's own HTTP settings
(``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
``..._BACKOFF_JITTER``) get short defaults unless the user set them; a 5xx of a proxy in front of the
server and a request that times out are retried once. MLflow does not send a create (a run, a logged model,
a version) again when its outcome is unknown: the registration looks for what that try made, by a tag or id
only it uses, and sends it again only when nothing is there. A server that refuses the credentials (HTTP 401) or
the permission (403) is one line naming ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (basic
auth) and ``MLFLOW_TRACKING_TOKEN``.

A shared tracking server, as the tests run one (tests/test_registry_server.py): ``mlflow server
--backend-store-uri postgresql+psycopg2://... --default-artifact-root s3://bucket/mlflow --no-serve-artifacts``
(``--app-name basic-auth`` for users). Clients then write bundles straight to S3 with their own AWS
credentials (the standard chain, ``AWS_ENDPOINT_URL``, as :mod:`dsaindex.artifacts.storage`), so bundle bytes
never pass through the server's workers and a server that stops mid-registration cannot cut an upload
short. Several registrations may run at once there (no lock): each gets its own version, and
``@candidate`` ends on the newest (:func:`.recovery._point_candidate`).

MLflow is imported inside the functions that use it, and every read and write goes through its client API:
the same code serves a sqlite or file store and a tracking server (PostgreSQL or any backend behind it).
Ctrl-C during a registration takes effect between two MLflow calls, never inside one, and the rollback
that follows a Ctrl-C or a store that stopped answering is bounded in time (:data:`ROLLBACK_S`).

The modules, lowest first (each imports only those above it):

- :mod:`.tracking`: tracking URIs, store location checks, the sqlite registration lock, retries, downloads.
- :mod:`.names`: registered-model names, metric and param keys.
- :mod:`.recovery`: unfinished registrations: recognising, looking past and undoing them.
- :mod:`.session`: the MLflow client session (HTTP timeouts, server probe, first touch of a sqlite store).
- :mod:`.versions`: what a ref means (:func:`resolve`) and :func:`promote`.
- :mod:`.register`: :func:`register_bundle`.
- :mod:`.browse`: :func:`list_versions`, :func:`show`, :func:`diff`, :func:`headline_metrics`.
- :mod:`.fetch`: :func:`pull`, :func:`load_uri`.

This package re-exports the public names; the constants are read where they are defined, so a test
that changes one (e.g. ``STALE_VERSION_S``) sets it on that module (:mod:`.recovery`).
"""

from dsaindex.artifacts.registry.browse import HEADLINE_METRICS, diff, headline_metrics, list_versions, show
from dsaindex.artifacts.registry.fetch import default_cache, load_uri, parse_models_uri, pull
from dsaindex.artifacts.registry.names import registered_name
from dsaindex.artifacts.registry.recovery import STALE_RUN_S, STALE_VERSION_S
from dsaindex.artifacts.registry.register import ROLLBACK_S, register_bundle
from dsaindex.artifacts.registry.session import HTTP_PROBE_SETTINGS, HTTP_SETTINGS, ensure_reachable
from dsaindex.artifacts.registry.tracking import (
    CANDIDATE,
    DEFAULT_EXPERIMENT,
    LOCK_TIMEOUT_S,
    PRODUCTION,
    REGISTERING,
    TAG,
    artifact_root,
    check_store_location,
    default_tracking_uri,
    resolve_tracking_uri,
    sqlite_path,
)
from dsaindex.artifacts.registry.versions import promote, resolve

__all__ = [
    "CANDIDATE",
    "DEFAULT_EXPERIMENT",
    "HEADLINE_METRICS",
    "HTTP_PROBE_SETTINGS",
    "HTTP_SETTINGS",
    "LOCK_TIMEOUT_S",
    "PRODUCTION",
    "REGISTERING",
    "ROLLBACK_S",
    "STALE_RUN_S",
    "STALE_VERSION_S",
    "TAG",
    "artifact_root",
    "check_store_location",
    "default_cache",
    "default_tracking_uri",
    "diff",
    "ensure_reachable",
    "headline_metrics",
    "list_versions",
    "load_uri",
    "parse_models_uri",
    "promote",
    "pull",
    "register_bundle",
    "registered_name",
    "resolve",
    "resolve_tracking_uri",
    "show",
    "sqlite_path",
]
