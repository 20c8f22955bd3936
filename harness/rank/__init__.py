"""Rank side: what runs inside a rank (worker, joining the world, runner, isolation, rank fixtures,
faults, collective tracing)."""
