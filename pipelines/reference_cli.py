"""``dsaindex reference ...``: the project's reference DSA checkpoint (training and evaluation)."""

from __future__ import annotations

import typer

reference_app = typer.Typer(no_args_is_help=True)
