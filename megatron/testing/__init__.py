"""Helpers shared by the tests and the CPU benchmarks (not used by training)."""
