"""Fidelity: validate, calibrate, what-if sweeps."""
