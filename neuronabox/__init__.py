"""NeuronaBox: emulate distributed DNN training from one real node."""

__version__ = "0.1.0"
