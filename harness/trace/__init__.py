"""Shared by both sides and the tools: collective trace records and what is read from them.

`records` is a record and the per-rank trace file that carries records from a rank to the
parent; `divergence` diffs the ranks' traces and names the first collective they disagree on;
`one_sided` notices, while a test runs, a rank waiting in a collective its peers will never
issue. Both read three smaller judgements: `exchange` (whether what the members of an all_to_all,
scatter, gather or list collective send pairs up with what they expect), `deadlock` (a wait cycle
across process groups) and `groups` (how messages name a process group). `checksums` holds the
ranks' replica digests and compares them (replica drift). Nothing here patches torch.distributed
(that is `harness.rank.tracing`).
"""
