"""Benchmarks and their reports: sweeps, tables and plots built from measured runs."""
