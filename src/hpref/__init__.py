"""hpref: human-preference modelling — preference-model training and multi-policy RL."""

from hpref import lazy_imports

__version__ = "0.1.0"

# Every process that imports hpref (the CLI, torchrun ranks, Ray actors, serve replicas) defers the
# third-party imports it never uses: ~1 s of each such process's start (hpref.lazy_imports).
lazy_imports.install()
