"""Parent side: the operating-system processes of a run, and nothing about tests.

The pytest process owns, per world size, a `pool.WorkerPool` of rank processes. The
`launcher.WorkerLauncher` starts the session's zygote by name (`harness.rank.zygote`: rank code),
cold or as a fork of pytest (`zygote_fork`), has it fork the ranks, and watches them until they
die. `rank_env` is the environment a rank starts with (torchrun's variables, a loopback network),
`gpu_locks` hands out GPUs between concurrent sessions (filelock), `rank_files` is where each
rank's side files live and `procfs` finds and ends what a rank left behind (both also used by
the ranks), `reaper` ends what a killed pytest left, and `sockets` shuts a torchrun rank's test connections
to end a wait gloo cannot cancel. Side rules: tests/test_import_graph.py.
"""
