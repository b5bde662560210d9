"""Third-party imports every hpref process would pay for and never use, deferred until used.

Importing any transformers model class imports two modules that import a scientific library at
import time only because it is installed (scikit-learn comes with sentence-transformers, hpref's
MiniLM extra; scipy with scikit-learn), for features hpref never uses:

* `transformers.generation.candidate_generator`: scikit-learn's `roc_curve` (and scipy.stats with
  it), for assisted decoding's `assistant_confidence_threshold`;
* `transformers.loss.loss_for_object_detection` and the other detection losses beside it: scipy's
  `linear_sum_assignment`, for the DETR family's matching.

and bitsandbytes, whose CPU backend `torch.compile`s at import (which imports torch's inductor):
~1.3 s of CPU in every process that builds a LoRA model, imported where no layer can be quantized:

* `peft.helpers` (by `import peft`, peft < 0.22) imports it at its top (inside `try`) for one SVD helper;
* `peft.tuners.lora.model` and `peft.utils.quantization_utils` import it whenever they wrap a layer,
  to ask whether the layer is one of bitsandbytes' classes: none can be while bitsandbytes is not
  imported (quantizing a model imports it first), so they ask `is_bnb_available()` only then.

Together ~2.4 s of CPU in every torchrun rank, Ray actor and serve replica (measured on the 2-core
EPYC of the README's figures: a model class's import went from 4.9 to 4.0 s of CPU, a model class
and peft's from 5.7 to 4.4 s). `install()` makes those names lazy. The transformers modules run with
their availability check answering False to that module alone (so it skips the import), then get the
real check back and, where the library is installed, a function of the same name that imports the
real one on its first call. `peft.helpers` runs with its bitsandbytes import failing for it alone,
then gets, where bitsandbytes is installed, a stand-in module that imports it on first use (and
so does vLLM's `vllm.multimodal.audio` for scipy.signal, ~1 s of every vLLM engine's start); the
other two peft modules get checks that answer False until bitsandbytes is imported. Assisted
decoding, DETR's loss and QLoRA behave as before (QLoRA's own modules import bitsandbytes as they
did). Where a module was imported before `install()`, it is left as it is.

transformers' `transformers.utils.import_utils` (and TRL's) maps every installed package to its
distribution at import (`importlib.metadata.packages_distributions()`, ~0.35 s of CPU over this venv's
~125 distributions, mostly `pathlib` objects for each of ~48,000 RECORD lines): while they import,
that function is `packages_distributions` here, the same mapping read from the same files as text
(~0.15 s). And `import transformers` reads the `__all__` of each of the ~2,400 files under
`transformers/models` to build its lazy import structure (~0.25 s): that structure is cached in
`$HPREF_CACHE` (`~/.cache/hpref`), keyed by those files' names, sizes and modification times (~0.03 s
to check), so an upgrade or an edited file rebuilds it.

One more import rule is about safety, not time: bitsandbytes >= 0.50's CPU backend, on a CPU with
AVX512-BF16, calls the `kernels` package at import (`get_kernel("kernels-community/...")`): online
that downloads compiled code from the Hugging Face Hub and runs it in this process, offline it
prints a warning. transformers >= 5.25 depends on `kernels`, so every install has it. Whoever imports
bitsandbytes (hpref's QLoRA, peft), it is imported with `kernels` hidden (`HIDDEN_WHILE_IMPORTING`):
bitsandbytes takes its own fallback (its built-in CPU kernels) and logs why.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections import defaultdict

#: (a module or package, the availability check in transformers.utils its code asks, the library
#: module it then imports from, the name). A module there whose source has that import is deferred.
DEFERRED = (
    ("transformers.generation.candidate_generator", "is_sklearn_available", "sklearn.metrics", "roc_curve"),
    ("transformers.loss.", "is_scipy_available", "scipy.optimize", "linear_sum_assignment"),
)


#: (a module, the library it imports at its top inside `try: ... except ImportError`, the name the
#: import binds there): the module runs with that import failing for it alone, then the name is bound
#: to a stand-in that imports the library on its first use.
DEFERRED_IMPORTS = (
    ("peft.helpers", "bitsandbytes", "bnb"),
    # vLLM's audio resampling (a text-only engine never resamples): ~1 s of every engine's start
    ("vllm.multimodal.audio", "scipy.signal", "scipy_signal"),
)

#: (a module, a library, the availability checks the module binds): after the module runs, each check
#: answers False there until the library is imported (it asks only to find the library's own classes).
UNTIL_IMPORTED = (
    ("peft.tuners.lora.model", "bitsandbytes", ("is_bnb_available", "is_bnb_4bit_available")),
    ("peft.utils.quantization_utils", "bitsandbytes", ("is_bnb_available", "is_bnb_4bit_available")),
)


#: a library -> a module hidden while the library's own top level runs (`import` of it fails there)
HIDDEN_WHILE_IMPORTING = {"bitsandbytes": "kernels"}


#: modules that call `importlib.metadata.packages_distributions()` at import: they get ours
TEXT_PACKAGE_MAP = ("transformers.utils.import_utils", "trl.import_utils")


def packages_distributions() -> dict[str, list[str]]:
    """`importlib.metadata.packages_distributions()` (Python 3.11's), the same mapping in the same
    order: each distribution's `top_level.txt`, else the `.py` files its RECORD lists (an egg-info
    install: the standard library's own reading), and its `Name` from the METADATA headers."""
    import importlib.metadata as metadata

    mapping: defaultdict[str, list[str]] = defaultdict(list)
    for dist in metadata.distributions():
        packages = (dist.read_text("top_level.txt") or "").split() or _top_level_inferred(dist)
        if packages:
            name = _name(dist)
            for package in packages:
                mapping[package].append(name)
    return dict(mapping)


def _top_level_inferred(dist) -> set[str]:
    """What `importlib.metadata._top_level_inferred` finds, from RECORD's text: the first part of
    each `.py` file's path (`PurePosixPath.parts`: no empty or `.` parts), or its stem."""
    import csv
    import importlib.metadata as metadata

    record = dist.read_text("RECORD")
    if record is None:
        return metadata._top_level_inferred(dist)
    names = set()
    for row in csv.reader(record.splitlines()):
        if not row:
            continue
        parts = [part for part in row[0].split("/") if part not in ("", ".")]
        if row[0].startswith("/"):
            parts.insert(0, "/")
        if parts and parts[-1].endswith(".py") and len(parts[-1]) > 3:  # PurePath.suffix == ".py"
            names.add(parts[0] if len(parts) > 1 else parts[-1][:-3])
    return names


def _name(dist) -> str:
    """The distribution's first `Name:` header (`dist.metadata["Name"]` without the email parser)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    for line in (text or "").splitlines():
        if not line:
            break  # the headers end at the first blank line
        if line[:5].lower() == "name:":
            return line[5:].strip()
    return dist.metadata["Name"]


def _with_text_package_map(spec):
    """Make `spec`'s module run with `packages_distributions` as `importlib.metadata`'s; in
    transformers' module, cache the `models` import structure (`cached_structure`)."""
    import importlib.metadata as metadata

    run_module = spec.loader.exec_module

    def exec_module(module):
        standard = metadata.packages_distributions
        metadata.packages_distributions = packages_distributions
        try:
            run_module(module)
        finally:
            metadata.packages_distributions = standard
        scan = getattr(module, "create_import_structure_from_path", None)
        if module.__name__ == "transformers.utils.import_utils" and callable(scan):
            module.create_import_structure_from_path = cached_structure(scan)

    spec.loader.exec_module = exec_module


#: bump when the cached structure's layout (transformers' own) could differ for the same files
STRUCTURE_FORMAT = 1


def cached_structure(scan):
    """`scan` (transformers' `create_import_structure_from_path`), its answer for the `models`
    folder (or its `__init__.py`) read from and written to the cache; any other path, an unreadable
    entry or an unwritable cache: `scan` itself."""
    import functools
    import hashlib
    import os
    import pickle

    @functools.lru_cache
    def models_structure(folder: str):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{STRUCTURE_FORMAT} {folder}".encode())
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    stat = os.stat(os.path.join(root, name))
                    digest.update(f"{root}/{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
        from hpref.cache_root import cache_root

        path = cache_root() / "transformers" / f"models-{digest.hexdigest()}.pickle"
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # absent, torn or foreign: rebuilt below
            pass
        structure = scan(folder)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}")
            temporary.write_bytes(pickle.dumps(structure))
            os.replace(temporary, path)  # readers see a whole file or none
        except OSError:
            pass
        return structure

    @functools.wraps(scan)
    def structure(module_path):
        path = os.fspath(module_path)
        folder = os.path.dirname(path) if os.path.isfile(path) else path
        if (
            os.path.basename(folder) == "models"
            and os.path.basename(os.path.dirname(folder)) == "transformers"
        ):
            return models_structure(folder)
        return scan(module_path)

    return structure


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


class _OnFirstUse:
    """Stands for a module not imported yet: its first attribute read imports it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)


class _RefuseTo(importlib.abc.MetaPathFinder):
    """Fails `import library` when the code importing it is `importer`'s own top level (a module
    that `importer` imports meanwhile finds the library as usual)."""

    def __init__(self, library: str, importer: str):
        self.library, self.importer = library, importer

    def find_spec(self, fullname, path, target=None):
        if fullname != self.library:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", __name__)):
            frame = frame.f_back  # the import machinery's own frames (and this module's)
        if frame is not None and frame.f_globals.get("__name__") == self.importer:
            raise ModuleNotFoundError(f"{fullname} deferred by hpref.lazy_imports", name=fullname)
        return None


def _defer_import(spec, importer: str, library: str, bound: str):
    """Make `spec`'s module run with its import of `library` failing, then bind the stand-in."""
    run_module = spec.loader.exec_module

    def exec_module(module):
        refuse = _RefuseTo(library, importer)
        sys.meta_path.insert(0, refuse)
        try:
            run_module(module)
        finally:
            sys.meta_path.remove(refuse)
        # the module bound its stand-in for a missing library (None, a placeholder): it is installed
        if importlib.util.find_spec(library) is not None:
            setattr(module, bound, _OnFirstUse(library))

    spec.loader.exec_module = exec_module


def _until_imported(spec, library: str, checks: tuple[str, ...]):
    """Make `spec`'s module's `checks` answer False until `library` is imported."""
    run_module = spec.loader.exec_module

    def exec_module(module):
        run_module(module)
        for name in checks:
            available = getattr(module, name)

            def check(available=available) -> bool:
                return library in sys.modules and available()

            setattr(module, name, check)

    spec.loader.exec_module = exec_module


def _hide_while_running(spec, hidden: str):
    """Make `spec`'s module run with `hidden` unimportable, then put `hidden` back as it was."""
    run_module = spec.loader.exec_module

    def exec_module(module):
        before = sys.modules.get(hidden, _MISSING)
        sys.modules[hidden] = None  # type: ignore[assignment]  # `from hidden import ...` raises
        try:
            run_module(module)
        finally:
            if before is _MISSING:
                sys.modules.pop(hidden, None)
            else:
                sys.modules[hidden] = before

    spec.loader.exec_module = exec_module


_MISSING = object()


class _Defer(importlib.abc.MetaPathFinder):
    """Finds a module of `DEFERRED` or `DEFERRED_IMPORTS` as the normal path finder does, and runs
    its code with its availability check answering False, or its library's import failing, to it
    (and only to it)."""

    def find_spec(self, fullname, path, target=None):
        imports = [(library, bound) for module, library, bound in DEFERRED_IMPORTS if module == fullname]
        until = [(library, checks) for module, library, checks in UNTIL_IMPORTED if module == fullname]
        rule = _rule(fullname)
        special = fullname in HIDDEN_WHILE_IMPORTING or fullname in TEXT_PACKAGE_MAP
        if rule is None and not imports and not until and not special:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module") or not hasattr(spec.loader, "get_source"):
            return spec
        if fullname in TEXT_PACKAGE_MAP:
            _with_text_package_map(spec)
            return spec
        if fullname in HIDDEN_WHILE_IMPORTING:
            _hide_while_running(spec, HIDDEN_WHILE_IMPORTING[fullname])
            return spec
        if until:
            (library, checks), source = until[0], spec.loader.get_source(fullname) or ""
            if all(name in source for name in checks):
                _until_imported(spec, *until[0])
            return spec
        if imports:
            (library, bound), source = imports[0], spec.loader.get_source(fullname) or ""
            if f"import {library} as {bound}" in source and library not in sys.modules:
                _defer_import(spec, fullname, library, bound)
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
