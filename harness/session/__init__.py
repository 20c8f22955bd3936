"""Parent side: what a pytest session does with each distributed test.

`flow.HarnessSession` is the per-test flow both modes share (task, results, trace diff, verdict,
publication to the report plugins); `pool_session` runs tests on warm pools it owns;
`torchrun_session` runs them under torchrun, where this pytest process is one rank (`torchrun_watch`
ends a one-sided wait there in seconds, through the torchrun store); `verdict` turns N
per-rank results into one outcome and says whether the world can run the next test.
"""
