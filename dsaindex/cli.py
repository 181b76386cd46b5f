"""The ``dsaindex`` command: composes the sub-apps of the subpackages.

Heavy libraries (torch, zarr, transformers) are imported inside commands so ``dsaindex --help`` is
instant. Errors on bad input (:class:`dsaindex.errors.DsaIndexError`) and usage errors (a missing argument,
an unknown option, a value out of range) print one line ``error: <problem> Fix: <fix>`` and exit with 2.
I/O failures (a full disk, a read-only or missing folder) print one such line naming the file and exit
with 1; a reader that goes away (``| head``) ends the command quietly. Ctrl-C exits with 130 after one line
saying what was kept.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

from dsaindex._version import __version__
from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.commands.bench import bench_app
from dsaindex.pipelines.commands.capture import register as register_pipelines
from dsaindex.pipelines.commands.plan import plan_app
from dsaindex.pipelines.commands.reference import reference_app
from dsaindex.pipelines.commands.registry import registry_app
from dsaindex.pipelines.commands.runtime import runtime_app
from dsaindex.pipelines.commands.serve import serve_cmd
from dsaindex.pipelines.commands.store import store_app
from dsaindex.pipelines.commands.train import eval_app, train_app


def _flags_without_type() -> None:
    """typer's help prints a ``<bool>`` type beside every flag (``--json  <bool>``); a flag takes no
    value, so show no type for it."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # a typer without type columns in its help
        return

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_type()
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
app.command("serve")(serve_cmd)
app.add_typer(plan_app, name="plan", help="Plan memory and admission for serving (LeanSparse's model, Eq. 1-5).")
app.add_typer(reference_app, name="reference", help="Train and evaluate the reference DSA checkpoint.")


_INTERRUPTED = "interrupted (Ctrl-C) before the command finished."


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Index building and artifact loading for DeepSeek Sparse Attention models."""


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(message, err=True, fg="red")
    sys.exit(code)


def _usage_error(exc: Exception) -> NoReturn:
    """A usage error of typer (or of click, which some libraries raise) as one line naming the help to read;
    a group run without a command shows its help instead."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()  # type: ignore[attr-defined]
        sys.exit(2)
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "dsaindex"
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    if not message.endswith((".", "?", "!")):
        message += "."
    _fail(f"error: {message} Fix: see `{command} --help` for the arguments and options.",
          getattr(exc, "exit_code", 2) or 2)


def _io_error(exc: OSError) -> str:
    """One line for an I/O failure: what failed, on which file, and what to do."""
    import errno

    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space on that disk (or point the command at another one) and run it again; what was "
               "completely written is kept, a partial bundle or version is not.")
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make that path writable for this user, or point the command at a writable one."
    elif exc.errno == errno.ENOENT:
        fix = "check the path (a folder that does not exist, or a file that was moved)."
    else:
        fix = "check the disk and the path, then run the command again."
    return f"error: {what}{where}. Fix: {fix}"


def _quiet_broken_pipe() -> NoReturn:
    """The reader of our output went away (``dsaindex ... | head``): stop without a traceback, as a pipe
    expects (exit 141, 128 + SIGPIPE)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(141)


def main() -> None:
    """Run the command line: usage errors and errors about the user's input print one line and exit 2;
    Ctrl-C exits 130 after saying what was kept."""
    try:
        code = app(standalone_mode=False)
    except DsaIndexError as err:
        _fail(f"error: {err.problem} Fix: {err.fix}")
    except typer.Exit as exc:  # typer returns most exit codes; this catches the rest
        sys.exit(exc.exit_code)
    except typer.Abort as exc:  # a command's own report of an interruption
        _fail(str(exc) or "interrupted", 130)
    except KeyboardInterrupt:
        _fail(_INTERRUPTED, 130)
    except typer.TyperException as exc:  # typer's usage errors: missing argument, unknown option, bad value
        _usage_error(exc)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except OSError as exc:  # the disk, not the user's input: one line naming the file and what to do, exit 1
        _fail(_io_error(exc), 1)
    except Exception as exc:
        click = sys.modules.get("click")  # only loaded where a library uses it
        if click is not None and isinstance(exc, click.ClickException):
            _usage_error(exc)
        raise
    # in non-standalone mode typer returns the exit code of a `typer.Exit`, and 130 for a Ctrl-C it caught
    if code == 130:
        _fail(_INTERRUPTED, 130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
