"""Rank side: what runs inside a rank (worker, runner, isolation, rank fixtures, faults, collective tracing)."""
