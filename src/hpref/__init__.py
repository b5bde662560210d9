"""hpref: human-preference modelling — preference-model training and multi-policy RL."""

__version__ = "0.1.0"
