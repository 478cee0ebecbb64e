"""Compression: a per-layer recipe from a run's Fisher profiles, its summary, the offline export of a
compressed checkpoint."""
