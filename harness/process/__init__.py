"""Parent side: the OS processes of a run (pool, launcher, zygote, reaper, rank environment, GPU locks)."""
