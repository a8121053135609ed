"""Nightly regression runner: a benchmark matrix, repeated, compared with a stored baseline."""
