"""Metrics: Prometheus exporters and recorders."""
