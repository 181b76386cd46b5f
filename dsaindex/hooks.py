"""Forward hooks on a model's modules, held in one place.

:class:`ModuleHooks` is the base of every hook set the project attaches to a transformers model (capture's
:class:`dsaindex.pipelines.capture.tap.IndexerTap`, the runtime's
:class:`dsaindex.runtime.transformers_adapter.RuntimeSelection`, the reference evaluation's input
capture). It keeps every handle, registers pre- and post-hooks through one method that honours the set's
``enabled`` switch, hands pre-hooks the module's forward arguments by parameter name, and removes all of
its hooks on exit. torch is not imported here: hooks are registered through the modules themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import torch

PreHook = Callable[["torch.nn.Module", dict[str, Any]], None]
PostHook = Callable[["torch.nn.Module", Any], Any]


class ModuleHooks:
    """A set of forward hooks: registered through :meth:`register`, removed together by :meth:`remove`.

    Use it as a context manager: entering calls :meth:`attach` (subclasses register their hooks there; the
    base attaches nothing, so a plain instance can be filled with :meth:`register` inside the ``with``),
    leaving removes every hook. ``enabled`` is one switch for every hook of the set: while it is off the
    hooks stay attached but neither observe nor change anything.
    """

    def __init__(self) -> None:
        self.enabled = True
        self._handles: list[Any] = []

    def attach(self) -> None:
        """Register this set's hooks (called on entering the context)."""

    def register(self, module: torch.nn.Module, pre: PreHook | None = None, post: PostHook | None = None) -> None:
        """Hook ``module``'s forward.

        Parameters
        ----------
        pre : called before each forward as ``pre(module, arguments)``, ``arguments`` the call's inputs by
            parameter name of ``module.forward``; it observes only (its return value is ignored)
        post : called after each forward as ``post(module, output)``; a value other than ``None`` replaces
            the module's output
        """
        if pre is not None:
            signature = inspect.signature(module.forward)

            def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                if self.enabled:
                    pre(mod, dict(signature.bind_partial(*args, **kwargs).arguments))

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        if post is not None:

            def post_hook(mod: torch.nn.Module, args: tuple, output: Any) -> Any:
                return post(mod, output) if self.enabled else None

            self._handles.append(module.register_forward_hook(post_hook))

    def remove(self) -> None:
        """Detach every hook registered so far."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
