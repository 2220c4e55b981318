"""Experiments: sweeps, reports, scaling-law fits."""
