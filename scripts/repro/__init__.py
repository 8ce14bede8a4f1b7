"""Reproductions of the SonicMoE paper's tables: one command each, results beside the paper's.

Run from the repository root, e.g. `python -m scripts.repro.activation_memory`; each script
writes a markdown table and a PNG into docs/repro/ (see docs/reproduction.md).
"""
