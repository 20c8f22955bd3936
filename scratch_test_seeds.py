import os
import pytest
import torch
from conformance.programs import codec
from conformance.programs.declared import declared_of
from conformance.programs.seeds import seed_programs
from conformance.programs.run import program_report
from conformance.protocol import BackendEnv
from conformance.suite import registry

NAMES = os.environ.get("BACKENDS", "reference").split(",")
WS = int(os.environ.get("WS", "2"))
CASES = []
for name in NAMES:
    adapter = registry.load(name)(BackendEnv(rank=0, world_size=WS, device=torch.device("cpu"), local_rank=0))
    for i, p in enumerate(seed_programs(declared_of(adapter), WS)):
        CASES.append(pytest.param(name, codec.encode(p), id=f"{name}-{i}"))

@pytest.mark.world_size(WS)
@pytest.mark.parametrize("name,code", CASES)
def test_seed(name, code, rank, world_size, device):
    prog = codec.decode(code)
    r = program_report(name, prog, rank=rank, device=device, local_rank=rank)
    assert not r.findings and not r.unsupported, name + ": " + prog.describe() + "\n" + "\n".join(r.findings) + r.unsupported + " refused=" + r.refused
