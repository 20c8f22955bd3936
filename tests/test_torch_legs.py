"""CI's torch legs leave out the self-tests of the session's own logic (tests/conftest.py's
TORCH_INDEPENDENT); this holds each of them to the rule that makes leaving it out safe, and the
torch-leg script to leaving out only those."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import TORCH_INDEPENDENT

REPO = Path(__file__).resolve().parents[1]
# What a module must not touch to count as torch-independent: the harness's rank side (tracer,
# dispatcher hooks, completion, faults, replicas, labels), its torchrun-script tools, a backend.
TORCH_SENSITIVE = re.compile(
    r"harness\.rank|spawn_ranks|dispatch_hooks|trace_script|flight_recorder|DistributedDataParallel|"
    r"fully_shard|FullyShardedDataParallel|_functional_collectives|funcol|--backend|inject_fault"
)


def test_every_module_left_out_of_the_torch_legs_keeps_to_the_rule() -> None:
    for path, reason in TORCH_INDEPENDENT.items():
        text = (REPO / path).read_text(encoding="utf-8")
        found = sorted(set(TORCH_SENSITIVE.findall(text)))
        assert not found, f"{path} ({reason}) uses {found}: it depends on torch; remove it from TORCH_INDEPENDENT"


def test_the_torch_legs_leave_out_exactly_the_marked_modules() -> None:
    script = (REPO / ".ci" / "torch-leg").read_text(encoding="utf-8")
    assert '-m "not torch_independent"' in script
    assert "tests/harness_tests" in script
