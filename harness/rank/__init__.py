"""Rank side: the code that runs inside a rank process, and only there.

`zygote` imports torch once per session and forks every rank (the launcher starts it by name);
`worker` joins the world once (`world`: the rank's device and process group) and serves tasks;
`runner` runs one test body (shared with torchrun lockstep mode); `isolation` puts back what a
test changed; `fixtures` is the rank-fixture registry (the parent reads only its names). The
collective trace: `tracing` wraps torch.distributed's entry points (importing it patches them,
so no parent-side module does), `collective_ops` says how each entry point's arguments read, and
`call_sites`, `tensor_names`, `labels` and `torch_fsdp_labels` name each record's source line,
tensors and unit. `faults` injects faults through the trace's interceptor.
"""
