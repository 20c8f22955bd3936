"""Parent side: the per-test flow, pool and torchrun lockstep sessions, the verdict."""
