"""Third-party imports every hpref process would pay for and never use, deferred until used.

Importing any transformers model class imports two modules that import a scientific library at
import time only because it is installed (scikit-learn comes with sentence-transformers, hpref's
MiniLM extra; scipy with scikit-learn), for features hpref never uses:

* `transformers.generation.candidate_generator`: scikit-learn's `roc_curve` (and scipy.stats with
  it), for assisted decoding's `assistant_confidence_threshold`;
* `transformers.loss.loss_for_object_detection` and the other detection losses beside it: scipy's
  `linear_sum_assignment`, for the DETR family's matching.

Together ~1.1 s of CPU in every torchrun rank, Ray actor and serve replica (measured on the 2-core
EPYC of the README's figures: a model class's import went from 4.9 to 4.0 s of CPU). `install()`
makes those names lazy: each module runs with its availability check answering False to that module
alone (so it skips the import), then gets the real check back and, where the library is installed,
a function of the same name that imports the real one on its first call. Assisted decoding and DETR's
loss behave as before. Where a module was imported before `install()`, it is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

#: (a module or package, the availability check in transformers.utils its code asks, the library
#: module it then imports from, the name). A module there whose source has that import is deferred.
DEFERRED = (
    ("transformers.generation.candidate_generator", "is_sklearn_available", "sklearn.metrics", "roc_curve"),
    ("transformers.loss.", "is_scipy_available", "scipy.optimize", "linear_sum_assignment"),
)


def _rule(fullname: str):
    for where, check, source, name in DEFERRED:
        if fullname == where or (where.endswith(".") and fullname.startswith(where)):
            return check, source, name
    return None


def _on_first_call(source: str, name: str):
    """A stand-in for `source.name` that imports it on its first call."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(source), name)(*args, **kwargs)

    call.__name__ = name
    return call


class _Defer(importlib.abc.MetaPathFinder):
    """Finds a module of `DEFERRED` as the normal path finder does, and runs its code with its
    availability check answering False to it (and only to it)."""

    def find_spec(self, fullname, path, target=None):
        rule = _rule(fullname)
        if rule is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module") or not hasattr(spec.loader, "get_source"):
            return spec
        check_name, source, name = rule
        if f"from {source} import {name}" not in (spec.loader.get_source(fullname) or ""):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            import transformers.utils as utils

            available = getattr(utils, check_name)

            def check() -> bool:
                # False only to the module being run; any other module imported meanwhile that binds
                # the check gets the truth
                return sys._getframe(1).f_globals.get("__name__") != fullname and available()

            setattr(utils, check_name, check)
            try:
                run_module(module)
            finally:
                setattr(utils, check_name, available)
            setattr(module, check_name, available)  # the features check it again when they run
            if available():
                setattr(module, name, _on_first_call(source, name))

        spec.loader.exec_module = exec_module  # this spec's own loader object: no other module's
        return spec


def install() -> None:
    """Defer those imports in this process (idempotent)."""
    if not any(isinstance(f, _Defer) for f in sys.meta_path):
        sys.meta_path.insert(0, _Defer())
