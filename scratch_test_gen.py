import os, warnings
import pytest
import torch
from hypothesis.errors import NonInteractiveExampleWarning
from conformance.programs import codec, draw
from conformance.programs.declared import declared_of
from conformance.programs.run import program_report
from conformance.protocol import BackendEnv
from conformance.suite import registry

warnings.simplefilter("ignore", NonInteractiveExampleWarning)
NAMES = os.environ.get("BACKENDS", "reference").split(",")
N = int(os.environ.get("NPROG", "8"))
CASES = []
for name in NAMES:
    adapter = registry.load(name)(BackendEnv(rank=0, world_size=2, device=torch.device("cpu"), local_rank=0))
    declared = declared_of(adapter)
    strat = draw.programs(declared, [2])
    for i in range(N):
        CASES.append(pytest.param(name, codec.encode(strat.example()), id=f"{name}-{i}"))

@pytest.mark.world_size(2)
@pytest.mark.parametrize("name,code", CASES)
def test_gen(name, code, rank, world_size, device):
    prog = codec.decode(code)
    r = program_report(name, prog, rank=rank, device=device, local_rank=rank)
    assert not r.findings and not r.unsupported, name + ": " + prog.describe() + "\n" + "\n".join(r.findings) + r.unsupported
