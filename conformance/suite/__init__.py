"""The suite's machinery: backend selection, expectations, session gate, vacuity, the rank-side backend fixture."""
