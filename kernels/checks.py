"""Input checks shared by the kernel wrappers.

A Triton kernel trusts its pointers: a wrong dtype, shape or device reads garbage or faults far from
the cause. So every wrapper checks its inputs first, one line per precondition, with these helpers.
Each raises :class:`KernelInputError` (a ``ValueError``) naming the argument, what it got and what it
wants, so callers can tell a caller's mistake from what Triton itself raises. The torch references
take no checks: they are the spec, and torch reports its own errors.
"""

from __future__ import annotations

from typing import NoReturn

import torch


class KernelInputError(ValueError):
    """A kernel wrapper was given an input of the wrong dtype, shape or device."""


def fail(name: str, got: object, want: object) -> NoReturn:
    """Raise ``KernelInputError("<name>: got <got>, want <want>")``."""
    raise KernelInputError(f"{name}: got {got}, want {want}")


def same_device(**tensors: torch.Tensor | None) -> None:
    """All ``tensors`` (None is skipped) on the device of the first one."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in named[1:]:
        if t.device != named[0][1].device:
            fail(name, f"a tensor on {t.device}", f"the device of {named[0][0]} ({named[0][1].device})")


def dtype(name: str, tensor: torch.Tensor, *allowed: torch.dtype) -> None:
    """``tensor.dtype`` is one of ``allowed``."""
    if tensor.dtype not in allowed:
        fail(name, f"dtype {tensor.dtype}", " or ".join(str(d) for d in allowed))


def floating(name: str, tensor: torch.Tensor) -> None:
    """``tensor`` holds floating-point numbers (the wrapper casts them to what the kernel reads)."""
    if not tensor.dtype.is_floating_point:
        fail(name, f"dtype {tensor.dtype}", "a floating-point dtype")


def shape(name: str, tensor: torch.Tensor, want: tuple[int | None, ...], dims: str = "") -> None:
    """``tensor.shape == want``, where None matches any size; ``dims`` names the axes in the message
    (``"B, N, D"``)."""
    got = tuple(tensor.shape)
    if len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want, strict=True)):
        return
    sizes = "(" + ", ".join("*" if w is None else str(w) for w in want) + ("," if len(want) == 1 else "") + ")"
    fail(name, f"shape {got}", f"[{dims}] = {sizes}" if dims else f"shape {sizes}")


def rank(name: str, tensor: torch.Tensor, ndim: int, dims: str = "") -> None:
    """``tensor`` has ``ndim`` axes (sizes checked elsewhere or free)."""
    shape(name, tensor, (None,) * ndim, dims)


def power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """``value`` is a power of two and at least ``minimum`` (sizes a kernel spans with ``tl.arange``)."""
    if value < minimum or value & (value - 1):
        fail(name, value, f"a power of two >= {minimum}")


def key_dim(name: str, value: int) -> None:
    """A key dim the tensor-core kernels tile in one block: a power of two >= 16 (``tl.dot``'s minimum)."""
    power_of_two(name, value, 16)


def at_least(name: str, value: int, minimum: int, why: str = "") -> None:
    """``value >= minimum``; ``why`` says where the bound comes from."""
    if value < minimum:
        fail(name, value, f">= {minimum}" + (f" ({why})" if why else ""))


def at_most(name: str, value: int, maximum: int, why: str = "") -> None:
    """``value <= maximum``; ``why`` says where the bound comes from."""
    if value > maximum:
        fail(name, value, f"<= {maximum}" + (f" ({why})" if why else ""))


def exactly_one(**options: object) -> None:
    """Exactly one of the keyword ``options`` is given (not None)."""
    given = [name for name, value in options.items() if value is not None]
    if len(given) != 1:
        fail(" / ".join(options), "none" if not given else " and ".join(given), "exactly one of them")
