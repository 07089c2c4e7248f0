"""The module paths of dino_opt before its modules moved into folders, kept
importable: ``from dino_opt.trainer import MemoryOptimizedDINOTrainer`` loads
``dino_opt.train.trainer`` and binds that same module object under the old
name (nothing is imported until it is asked for)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__all__ = ["MODULE_ALIASES", "install_module_aliases", "make_callable"]

#: Old module path -> the module that holds its names now. Paths whose
#: folder kept the module's name (``dino_opt.config``, ``dino_opt.data``,
#: ``dino_opt.checkpoint``, ...) need none: the folder exports the same names.
MODULE_ALIASES = {
    "dino_opt.analysis": "dino_opt.observe.analysis",
    "dino_opt.build": "dino_opt.train.build",
    "dino_opt.datasets": "dino_opt.data.builtin",
    "dino_opt.ema": "dino_opt.ops.ema",
    "dino_opt.evaluate": "dino_opt.eval.evaluate",
    "dino_opt.hardware": "dino_opt.tune.hardware",
    "dino_opt.health": "dino_opt.observe.health",
    "dino_opt.knn": "dino_opt.eval.knn",
    "dino_opt.loss": "dino_opt.ops.loss",
    "dino_opt.memory": "dino_opt.observe.memory",
    "dino_opt.optimize": "dino_opt.tune.optimize",
    "dino_opt.plots": "dino_opt.observe.plots",
    "dino_opt.presets": "dino_opt.config.presets",
    "dino_opt.profiler": "dino_opt.observe.profiler",
    "dino_opt.runfiles": "dino_opt.observe.runfiles",
    "dino_opt.runlog": "dino_opt.observe.runlog",
    "dino_opt.schedules": "dino_opt.ops.schedules",
    "dino_opt.throughput": "dino_opt.tune.throughput",
    "dino_opt.trainer": "dino_opt.train.trainer",
    "dino_opt.watchdog": "dino_opt.runtime.watchdog",
}


class _AliasLoader(importlib.abc.Loader):
    """Hands out the target module itself, so both names share one object
    (a monkeypatch or an isinstance check sees the same classes)."""

    def __init__(self, target: str):
        self.target = target
        self.target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system has set the alias's spec on the shared module; it
        # keeps its own (reload and pickling go by the real name).
        module.__spec__ = self.target_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULE_ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(MODULE_ALIASES[fullname]))


def install_module_aliases() -> None:
    """Puts the alias finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def make_callable(module: types.ModuleType, function) -> None:
    """Makes ``module`` callable as ``function``: ``dino_opt.train`` is both
    the package of the training engine (``dino_opt.train.build``, ...) and
    the one-call :func:`dino_opt.api.train`, so that neither the modules'
    paths nor the call shadow each other."""
    kind = type(
        f"Callable{type(module).__name__}",
        (type(module),),
        {"__call__": staticmethod(function), "__slots__": ()},
    )
    module.__class__ = kind
