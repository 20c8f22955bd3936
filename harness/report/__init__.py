"""Parent side: what report plugins receive, and the built-in report plugins.

`results` is the data every report plugin gets per test (`DistributedTestResult`, one
`RankCase` per rank, built once by `rank_cases`); `junit` (per-rank JUnit files), `trace_tables`
(`traces/<test>.txt`) and `run_summary` (the end-of-run section and a failed test's one-line
reason) are plugins on the hooks of `harness.hookspecs`, as any other report is.
"""
