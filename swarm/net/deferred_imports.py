"""Modules hivemind imports at its own import but Swarm never calls, loaded on first use instead.

``hivemind.averaging.load_balancing`` does ``import scipy.optimize`` at import time for one function (its
averager's load balancing, ``linprog``) that Swarm's exchange does not use. That import is ~0.3 s of an idle
machine's CPU and holds the GIL while a restarted peer builds its trainer (docs/BENCHMARKS.md, "Fast rejoin").
``defer_scipy_optimize`` puts a stand-in in its place: the stand-in carries the module's spec attributes
(``__file__``, ``__path__``, …), so scanning ``sys.modules`` (``inspect.getmodule``, which torch calls while it
registers operators) reads nothing else; any other attribute (``scipy.optimize.linprog``) imports the real module
and answers from it. ``importlib.util.LazyLoader`` is not enough: it loads on any attribute, ``__file__`` included.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

_NAME = "scipy.optimize"
_lock = threading.Lock()


class _Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a module until an attribute it does not carry is read."""

    def __getattr__(self, attr: str) -> object:
        with _lock:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            real = importlib.import_module(self.__name__)
        return getattr(real, attr)


def defer_scipy_optimize() -> bool:
    """Put a stand-in for ``scipy.optimize`` in ``sys.modules`` unless it is imported already (or scipy is missing).

    Neither scipy nor numpy is imported here: the submodule's spec is found on the package's path without
    importing the package. True when the stand-in was registered.
    """
    if _NAME in sys.modules:
        return False
    package = importlib.util.find_spec("scipy")  # a top-level spec: found, not imported
    if package is None or not package.submodule_search_locations:
        return False
    spec = importlib.machinery.PathFinder.find_spec(_NAME, list(package.submodule_search_locations))
    if spec is None or spec.origin is None:
        return False
    module = _Deferred(_NAME)
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__file__ = spec.origin
    module.__package__ = _NAME
    module.__path__ = list(spec.submodule_search_locations or [])
    sys.modules[_NAME] = module
    return True
