"""Benchmarks: scripts that print tables of ratios measured side by side (README, "Benchmarks")."""
