"""Self-tests: what every inner pytest session they start inherits."""

import os

# An inner session is a pytest parent that computes next to nothing itself; with one intra-op
# thread, torch starts no thread pool in it, so the session stays single-threaded and its zygote is
# forked from it instead of importing torch again (~2 s of CPU per session; see
# harness.process.zygote_fork). Ranks get OMP_NUM_THREADS=1 anyway (harness.process.launcher). A user's own
# setting is kept: its sessions then start their zygotes cold.
os.environ.setdefault("OMP_NUM_THREADS", "1")
