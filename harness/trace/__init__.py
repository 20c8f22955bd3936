"""Both sides: trace records, the cross-rank diff and one-sided waits (never patches torch.distributed)."""
