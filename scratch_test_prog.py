import pytest
from conformance.programs import program as p
from conformance.programs.run import program_report
from conformance.protocol import ShardingStrategy as S, ApiForm

PROGS = {
 "sgd-train": p.Program(2, p.ModelShape(3,5,2,2,True,()), p.Setup(S.FULL_SHARD, ApiForm.WRAPPER, "leaves"),
     (p.Backward(2), p.Step(), p.Backward(), p.Step(), p.SetMode(False), p.EvalForward()), 3),
 "zero1": p.Program(2, p.ModelShape(3,5,2,2,False,(1,)), p.Setup(S.SHARD_OPTIM_STATE, ApiForm.WRAPPER, "none", optimizer="adam"),
     (p.Backward(), p.Step(), p.ZeroGrad(), p.Backward(3), p.Step(), p.SaveLoad("full"), p.Backward(), p.Step()), 4),
}

@pytest.mark.world_size(2)
@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("name", ["reference", "torch-fsdp1", "torch-fsdp2", "torch-zero", "deepspeed"])
def test_prog(name, prog, rank, world_size, device):
    r = program_report(name, PROGS[prog], rank=rank, device=device, local_rank=rank)
    print(r)
    assert not r.findings and not r.refused, r
