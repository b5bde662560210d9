"""`hpref.lazy_imports`: what transformers imports only because a library is installed waits until
it is used, and then works as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sklearn")
pytest.importorskip("scipy")


def test_a_model_class_import_skips_sklearn_and_scipy_until_a_deferred_name_is_called():
    # Wrong if every rank, actor and replica still paid ~1 s for scikit-learn and scipy (they were
    # imported), if assisted decoding or the detection losses lost their functions or saw those
    # libraries as missing, or if the deferral lied to another module that asks the same check.
    script = textwrap.dedent(
        """
        import sys
        import hpref
        from transformers import AutoModel, LlamaForCausalLM
        import transformers.generation.candidate_generator as generation
        import transformers.loss.loss_for_object_detection as detection
        import transformers.loss.loss_rt_detr as rt_detr
        from transformers.utils import is_scipy_available, is_sklearn_available
        print("before", "sklearn" in sys.modules, "scipy.optimize" in sys.modules)
        print("checks", generation.is_sklearn_available(), detection.is_scipy_available(),
              is_sklearn_available(), is_scipy_available())
        import transformers.data.metrics as metrics  # binds the check after the deferral: the truth
        print("metrics", metrics.is_sklearn_available())
        import numpy as np
        from scipy.optimize import linear_sum_assignment
        from sklearn.metrics import roc_curve
        labels, scores = [0, 1, 1, 0], [0.1, 0.8, 0.6, 0.4]
        same = [a.tolist() for a in generation.roc_curve(labels, scores)] == [
            a.tolist() for a in roc_curve(labels, scores)]
        cost = np.array([[4.0, 1.0], [2.0, 8.0]])
        matched = [a.tolist() for a in rt_detr.linear_sum_assignment(cost)] == [
            a.tolist() for a in linear_sum_assignment(cost)]
        print("after", same, matched, detection.linear_sum_assignment.__name__)
        import importlib.metadata, transformers.utils.import_utils as import_utils
        standard = importlib.metadata.packages_distributions()
        print("package map", import_utils.PACKAGE_DISTRIBUTION_MAPPING == standard,
              importlib.metadata.packages_distributions.__module__)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines == [
        "before False False",
        "checks True True True True",
        "metrics True",
        "after True True linear_sum_assignment",
        "package map True importlib.metadata",
    ], done.stdout


def test_a_lora_model_builds_without_bitsandbytes_and_quantized_layers_are_still_found():
    # Wrong if every process that builds a LoRA model still paid ~1.3 s for bitsandbytes and the
    # inductor its CPU backend compiles with, if peft's SVD helper lost bitsandbytes, or if peft no
    # longer recognised a bitsandbytes layer once bitsandbytes is imported (QLoRA would wrap its
    # 4-bit layers as plain Linear ones).
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    script = textwrap.dedent(
        """
        import sys
        import hpref
        import transformers
        from peft import LoraConfig, get_peft_model
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, vocab_size=64)
        lora_config = LoraConfig(r=2, target_modules=["q_proj"])
        model = get_peft_model(transformers.LlamaForCausalLM(config), lora_config)
        import peft.helpers, peft.tuners.lora.model as lora, peft.utils.quantization_utils as quant
        print("built", "bitsandbytes" in sys.modules, lora.is_bnb_4bit_available(), quant.is_bnb_available())
        import bitsandbytes
        # peft < 0.22 imports bitsandbytes in `peft.helpers` (deferred: a stand-in); 0.22 dropped it
        bnb = getattr(peft.helpers, "bnb", None)
        print("stand-in", "none" if bnb is None else bnb.functional is bitsandbytes.functional)
        print("after", lora.is_bnb_available(), lora.is_bnb_4bit_available(), quant.is_bnb_4bit_available())
        layer = bitsandbytes.nn.Linear4bit(16, 16, bias=False)
        print("backend", type(quant.resolve_quantization_backend(layer)).__name__)
        """
    )
    import peft.helpers  # this process's peft: which of the two forms the child will meet

    helpers_imports_bnb = "import bitsandbytes as bnb" in Path(peft.helpers.__file__).read_text()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "built False False False",
        "stand-in True" if helpers_imports_bnb else "stand-in none",
        "after True True True",
        "backend Bnb4bitBackend",
    ], done.stdout


def test_the_package_map_transformers_reads_at_import_is_the_standard_librarys():
    # Wrong if transformers (every process's import) saw another package -> distribution mapping
    # than `importlib.metadata.packages_distributions()` gives: it decides from it which optional
    # libraries are installed, and under what distribution name.
    import importlib.metadata

    from hpref.lazy_imports import packages_distributions

    standard = importlib.metadata.packages_distributions()
    assert len(standard) > 50  # this venv's packages, not an empty comparison
    assert packages_distributions() == standard
    # transformers' own copy (taken at its import, through ours) is checked in a fresh process by
    # the first test of this module: here sys.path has changed since transformers was imported


def test_transformers_models_structure_is_cached_per_file_state_and_equals_the_scan(tmp_path, monkeypatch):
    # Wrong if every process still read ~2,400 files at `import transformers` (the cache never hit),
    # if an edited or upgraded transformers kept a stale structure (a model class missing or in the
    # wrong file), if a path other than `transformers/models` were cached, or if an unwritable cache
    # broke the import.
    from hpref.lazy_imports import cached_structure

    models = tmp_path / "site" / "transformers" / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "modeling_llama.py").write_text("__all__ = ['A']\n")
    (models / "__init__.py").write_text("")
    calls = []

    def scan(path):
        calls.append(str(path))
        return {"llama": {"files": sorted(p.name for p in (models / "llama").iterdir())}}

    monkeypatch.setenv("HPREF_CACHE", str(tmp_path / "cache"))
    first = cached_structure(scan)(models)
    assert calls == [str(models)] and list((tmp_path / "cache" / "transformers").glob("models-*.pickle"))
    again = cached_structure(scan)  # a new process: only the cache file is shared
    assert again(models / "__init__.py") == first and again(str(models)) == first and len(calls) == 1
    (models / "llama" / "modeling_llama.py").write_text("__all__ = ['A', 'B']\n")  # an edit: size differs
    assert cached_structure(scan)(models) == first and len(calls) == 2
    other = tmp_path / "site" / "transformers" / "other"
    assert cached_structure(scan)(other) == first and calls[-1] == str(other)  # not cached: scanned
    monkeypatch.setenv("HPREF_CACHE", "/proc/no-such-cache")  # unwritable
    assert cached_structure(scan)(models) == first and len(calls) == 4

    import transformers
    import transformers.utils.import_utils as import_utils

    folder = str(Path(transformers.__file__).parent / "models")
    scanned = import_utils.create_import_structure_from_path.__wrapped__(folder)
    assert import_utils.create_import_structure_from_path(folder) == scanned


def test_a_deferred_import_binds_a_stand_in_that_imports_the_library_on_first_use(tmp_path, monkeypatch):
    # Wrong if a module of `DEFERRED_IMPORTS` changed how it imports the library (the rule would
    # silently stop deferring: vLLM's engines would pay ~1 s for scipy.signal again, peft's LoRA
    # ~1.3 s for bitsandbytes), if the module kept its own "not installed" placeholder for an
    # installed library (its feature would fail), or if the library were imported before its first
    # use. A module that no longer names the library at all (peft >= 0.22's helpers) needs no rule.
    import importlib.util

    import hpref.lazy_imports as lazy

    for module, library, bound in lazy.DEFERRED_IMPORTS:
        top = importlib.util.find_spec(module.split(".")[0])  # the package, not the module: no import
        if top is not None:
            source = Path(top.submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
            text = source.read_text()
            assert f"import {library} as {bound}" in text or library not in text, module
    (tmp_path / "fakeheavy.py").write_text("VALUE = 42\n")
    (tmp_path / "fakeaudio.py").write_text(
        "try:\n    import fakeheavy as heavy\nexcept ImportError:\n    heavy = 'not installed'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lazy, "DEFERRED_IMPORTS", (("fakeaudio", "fakeheavy", "heavy"),))
    import fakeaudio

    assert "fakeheavy" not in sys.modules and type(fakeaudio.heavy).__name__ == "_OnFirstUse"
    assert fakeaudio.heavy.VALUE == 42 and "fakeheavy" in sys.modules
    for name in ("fakeaudio", "fakeheavy"):
        sys.modules.pop(name, None)
