"""Evaluation: task generators, metrics and sweeps."""
