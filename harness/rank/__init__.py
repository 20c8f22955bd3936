"""Rank side: the code that runs inside a rank process, and only there.

`zygote` imports torch once per session and forks every rank (the launcher starts it by name);
`worker` joins the world once (`world`: the rank's device and process group) and serves tasks;
`runner` runs one test body (shared with torchrun mode); `isolation` puts back what a
test changed; `fixtures` is the rank-fixture registry (the parent reads only its names). The
collective trace: `tracing` wraps torch.distributed's entry points (importing it patches them,
so no parent-side module does), `dispatch_hooks` hooks the dispatcher ops below them (what DDP's
reducer and other C++ issue), `completion` says when a record's work completed,
`collective_ops` says how each entry point's and op's arguments read, and `call_sites`,
`tensor_names`, `labels`, `torch_fsdp_labels` and `ddp_buckets` name each record's source line,
tensors and unit. `faults` injects faults through the trace's interceptor. `replicas` digests
what a strategy keeps replicated, for the replica-drift check (`harness.trace.checksums` compares).
"""
