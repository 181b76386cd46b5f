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
SkipHook = Callable[["torch.nn.Module", dict[str, Any]], Any]


class _ForwardSkip:
    """``module.forward`` wrapped (as an instance attribute, which ``nn.Module.__call__`` calls) so that a
    skip hook may answer in its place; :meth:`remove` puts back what was there."""

    def __init__(self, hooks: ModuleHooks, module: torch.nn.Module, signature: inspect.Signature,
                 skip: SkipHook) -> None:
        import functools

        self.module = module
        self.had_own = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if hooks.enabled:
                out = skip(module, dict(signature.bind_partial(*args, **kwargs).arguments))
                if out is not None:
                    return out
            return original(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        if self.had_own:
            self.module.forward = self.previous
        else:
            self.module.__dict__.pop("forward", None)


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

    def register(self, module: torch.nn.Module, pre: PreHook | None = None, post: PostHook | None = None,
                 skip: SkipHook | None = None) -> None:
        """Hook ``module``'s forward.

        Parameters
        ----------
        pre : called before each forward as ``pre(module, arguments)``, ``arguments`` the call's inputs by
            parameter name of ``module.forward``; it observes only (its return value is ignored)
        post : called after each forward as ``post(module, output)``; a value other than ``None`` replaces
            the module's output
        skip : called after ``pre``, in place of the forward, as ``skip(module, arguments)``; a value other
            than ``None`` is the forward's output and the module's own forward does not run (``post`` still
            sees it). For work the hooks make unnecessary (scores nobody reads).
        """
        signature = inspect.signature(module.forward)
        if pre is not None:

            def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                if self.enabled:
                    pre(mod, dict(signature.bind_partial(*args, **kwargs).arguments))

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        if skip is not None:
            self._handles.append(_ForwardSkip(self, module, signature, skip))
        if post is not None:

            def post_hook(mod: torch.nn.Module, args: tuple, output: Any) -> Any:
                return post(mod, output) if self.enabled else None

            self._handles.append(module.register_forward_hook(post_hook))

    def remove(self) -> None:
        """Detach every hook registered so far (in the reverse order: a forward wrapped twice unwraps)."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
