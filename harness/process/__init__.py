"""Parent side: the operating-system processes of a run, and nothing about tests.

The pytest process owns, per world size, a `pool.WorkerPool` of rank processes, which
`launcher.WorkerLauncher` forks from the session's `zygote` (started cold, or as a fork of pytest
by `zygote_fork`) and watches until they die. `rank_env` is the environment a rank starts with
(torchrun's variables, a loopback network), `gpu_locks` hands out GPUs between concurrent
sessions (filelock), `rank_files` where each rank's side files live (both
sides agree on it), `procfs` finds and ends what a rank left behind (both sides use it), and
`reaper` ends what a killed pytest left. Side rules: tests/test_import_graph.py (`HARNESS_SIDES`).
"""
