"""The ``dsaindex`` command: composes the sub-apps of the subpackages.

Heavy libraries (torch, zarr, transformers) are imported inside commands so ``dsaindex --help`` is
instant. Errors on bad input (:class:`dsaindex.errors.DsaIndexError`) print one line and exit with 2.
"""

from __future__ import annotations

import sys

import typer

from dsaindex._version import __version__
from dsaindex.artifacts.cli import registry_app, store_app
from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.bench import bench_app
from dsaindex.pipelines.cli import register as register_pipelines
from dsaindex.pipelines.reference_cli import reference_app
from dsaindex.pipelines.runtime_cli import runtime_app
from dsaindex.pipelines.train_cli import eval_app, train_app

app = typer.Typer(
    name="dsaindex",
    help="Index building and artifact loading for DeepSeek Sparse Attention models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
register_pipelines(app)
app.add_typer(store_app, name="store", help="Inspect capture stores.")
app.add_typer(registry_app, name="registry", help="Browse, compare, promote and pull registered artifacts.")
app.add_typer(train_app, name="train", help="Train artifacts on capture stores.")
app.add_typer(eval_app, name="eval", help="Evaluate artifacts on held-out captures.")
app.add_typer(runtime_app, name="runtime", help="Load and validate artifacts as a server would.")
app.add_typer(bench_app, name="bench", help="Measure speed and size, JSON out.")
app.add_typer(reference_app, name="reference", help="Train and evaluate the reference DSA checkpoint.")


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Index building and artifact loading for DeepSeek Sparse Attention models."""


def main() -> None:
    try:
        app(standalone_mode=False)
    except DsaIndexError as err:
        typer.secho(f"error: {err.problem} Fix: {err.fix}", err=True, fg="red")
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
