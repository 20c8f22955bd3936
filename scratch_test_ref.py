import pytest
from conformance.programs import program as p
from conformance.programs.run import program_report
from conformance.protocol import ShardingStrategy as S, ApiForm

def prog(strategy, plan, **kw):
    return p.Program(2, p.ModelShape(5,7,3,2,True,()), p.Setup(strategy, ApiForm.WRAPPER, plan, use_orig_params=False, **kw), (p.Backward(),), 1)
PROGS = {
 "noshard-nested": prog(S.NO_SHARD, "nested"),
 "full-nested": prog(S.FULL_SHARD, "nested"),
 "noshard-leaves": prog(S.NO_SHARD, "leaves"),
 "noshard-nested-mp": prog(S.NO_SHARD, "nested", param_dtype="float16", offload_params=True),
}
@pytest.mark.world_size(2)
@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("name", ["reference", "torch-fsdp1"])
def test_prog(name, prog, rank, world_size, device):
    r = program_report(name, PROGS[prog], rank=rank, device=device, local_rank=rank)
    assert not r.findings and not r.unsupported, "\n".join(r.findings)+r.unsupported
