"""Which trainer frameworks (the ``integrations`` extra) are here, and timm without torchvision.

Loaded by path from tests/integrations and tests/docs (tests are not a package). timm's
``timm/__init__.py`` and ``timm/utils/__init__.py`` import timm.layers, which imports
torchvision; the package index may hold only a torchvision built for another torch ("operator
torchvision::nms does not exist"), or none. CI installs timm with ``--no-deps`` and no
torchvision; :func:`require` then loads timm's real ``timm.utils.cuda`` (NativeScaler),
``timm.utils.clip_grad`` and ``timm.scheduler`` modules under their own names, with those two
``__init__`` files not run. Nothing of timm is replaced: the code that runs is timm's.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

EXTRA = "pip install -e '.[integrations]' (CI: see .ci/run)"
MODULES = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers",
           "timm": "timm", "jax": "jax", "optax": "optax"}
#: Names installed by another extra than ``integrations`` (docs blocks marked ``needs=jax,optax``).
OTHER_EXTRAS = {"jax": "pip install -e '.[jax]'", "optax": "pip install -e '.[optax]'"}


def require(*names: str) -> str | None:
    """None when every framework named imports here, else why not (a skip reason)."""
    missing = [n for n in names if importlib.util.find_spec(MODULES[n]) is None]
    if missing:
        return f"{', '.join(missing)} not installed: {OTHER_EXTRAS.get(missing[0], EXTRA)}"
    if "timm" in names:
        return _timm_reason()
    return None


def _timm_reason() -> str | None:
    try:
        importlib.import_module("timm.utils.cuda")
        return None
    except ImportError as exc:
        if "torchvision" not in str(exc):
            return f"timm does not import: {exc}"
    except RuntimeError as exc:  # a torchvision built for another torch
        if "torchvision" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "timm" or m.startswith("timm.")]:
        del sys.modules[name]  # a failed import may leave half-initialised modules
    _bare_package("timm")
    _bare_package("timm.utils")
    importlib.import_module("timm.utils.cuda")
    return None


def _bare_package(name: str) -> None:
    """Register package ``name`` with its real search path, without running its __init__."""
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
