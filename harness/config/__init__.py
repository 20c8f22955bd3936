"""Parent side: options and the decisions made from them before tests run.

`torchrun` (the one reader of the torchrun world in the environment), `devices` (which device
and communication backend a world gets), `world_sizes` (which sizes each test runs at),
`preflight` (bad input refused before the first test; the reports directory), `repro` (what a
`REPRO:` line carries, `--repro`), `signals` (SIGINT and SIGTERM end the session the same way),
`deadlines` (a distributed test's deadline: `--test-timeout` or pytest-timeout's limit for it).
"""
