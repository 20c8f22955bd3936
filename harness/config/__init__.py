"""Parent side: options and decisions made before tests run (devices, world sizes, preflight, repro, signals)."""
