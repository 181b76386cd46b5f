"""Import-only stand-in for torchvision in the CPU test environment (see engines/sglang/README.md).

PyPI has no torchvision build for the CPU torch 2.13 these tests run on (the PyPI wheel needs CUDA torch
and fails at import). SGLang's config package imports torchvision at module level for its multimodal
processors, which these tests never call; any attribute of this stand-in raises when used.
"""

import sys
import types


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, item):
        return _Unavailable(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is not available in the CPU test environment (torchvision stand-in).")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        full = f"{self.__name__}.{item}"
        return _Unavailable(full)


__version__ = "0.0.0+stand-in"
for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops", "models"):
    _mod = _Module(f"torchvision.{_name}")
    sys.modules[f"torchvision.{_name}"] = _mod
sys.modules[__name__].transforms = sys.modules["torchvision.transforms"]
sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
sys.modules["torchvision.transforms"].v2 = sys.modules["torchvision.transforms.v2"]
sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
sys.modules["torchvision.transforms"].InterpolationMode = _Unavailable("torchvision.transforms.InterpolationMode")


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Unavailable(f"torchvision.{item}")
