"""A collective's label is a function of what the current test did on a rank, never of the rank
process's history.

Pool workers are warm: each has run other tests before, and the ranks of one test have
allocated and freed different objects on the way (rank 0 gathers reports, for instance). Were a
label to depend on that history, two ranks issuing the same collective could label it
differently, and the trace diff would report "ranks issued divergent collectives" for a
collective that did not diverge (seen on torch FSDP1: one rank labelled unit2's all-gather
``inp.weight, ...``, the other ``unit2.inp.weight, ...``). Each test here computes a label in
two histories in this process and requires the same answer. They call the functions the
harness's forward hook calls (``note_outermost_module``) and the FSDP1 unit labeller on a
stand-in handle, so they need no ranks and no FSDP import.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch.nn as nn

from harness.rank import labels, tensor_names, torch_fsdp_labels, tracing

UNIT_LABEL = "unit.proj.weight, unit.proj.bias"


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unit = Unit()


@pytest.fixture(autouse=True)
def fresh_labels() -> Iterator[None]:
    labels.reset()
    yield
    labels.reset()


def fsdp1_label(unit: nn.Module) -> str | None:
    """The harness's label for an all-gather of `unit`'s flat parameter (an FSDP1 handle's fields)."""
    handle = types.SimpleNamespace(
        flat_param=types.SimpleNamespace(_fqns=("proj.weight", "proj.bias")), _fully_sharded_module=unit
    )
    return torch_fsdp_labels._fsdp1_unit(handle)


def model_at(address: int) -> Model:
    """A new model at `address`, where a model was just freed (CPython's allocator hands that
    block to the next object of its size, so the first try lands there)."""
    tries = []
    for _ in range(100):
        model = Model()
        if id(model) == address:
            return model
        tries.append(model)  # kept alive, so the next try gets another block
    pytest.skip("this interpreter did not put a new model where a freed one was: the recycled id cannot be set up")


def freed_root_address() -> int:
    """Earlier in the test, a model ran as the outermost module (the oracle) and was freed."""
    oracle = Model()
    tensor_names.note_outermost_module(oracle)
    address = id(oracle)
    del oracle
    return address


def test_a_model_at_a_freed_roots_address_is_named_as_on_a_rank_that_gave_it_a_new_one():
    # A rank whose allocator gave the model a fresh address (made before the oracle was freed).
    fresh = Model()
    assert id(fresh) != freed_root_address()
    tensor_names.note_outermost_module(fresh)
    assert fsdp1_label(fresh.unit) == UNIT_LABEL
    assert tensor_names.names_of([fresh.unit.proj.weight]) == ("unit.proj.weight",)

    # A rank whose allocator put the model where the freed oracle was: the same names.
    labels.reset()
    recycled = model_at(freed_root_address())
    tensor_names.note_outermost_module(recycled)
    assert fsdp1_label(recycled.unit) == UNIT_LABEL
    assert tensor_names.names_of([recycled.unit.proj.weight]) == ("unit.proj.weight",)


def test_a_root_at_a_freed_roots_address_takes_its_place_when_noted():
    # The unit ran on its own, then the model: the unit's own root names it first ("proj"),
    # wherever the allocator put the model.
    def unit_path(model_at_freed_address: bool) -> str:
        labels.reset()
        model = None if model_at_freed_address else Model()
        address = freed_root_address()
        model = model_at(address) if model is None else model
        tensor_names.note_outermost_module(model.unit)
        tensor_names.note_outermost_module(model)
        return tensor_names.module_path(model.unit.proj)

    assert unit_path(model_at_freed_address=True) == unit_path(model_at_freed_address=False) == "proj"


def test_a_module_that_outlives_a_test_is_named_afresh_in_the_next():
    model = Model()
    # The earlier test registered the model under a prefix; this rank labelled its unit then.
    tensor_names.name_tensor(model, "net")
    assert fsdp1_label(model.unit) == f"net.{UNIT_LABEL.replace(', ', ', net.')}"
    labels.reset()  # the next test uses the same model without the prefix
    tensor_names.note_outermost_module(model)
    assert fsdp1_label(model.unit) == UNIT_LABEL  # as on a rank whose process never ran the earlier test


def test_fsdp_imported_in_an_earlier_test_is_labelled_from_the_start_of_the_next(monkeypatch, tmp_path):
    # This process imported FSDP1 in an earlier test but ran no forward since (another rank did,
    # and wrapped its entry points then). Stand-ins for torch's modules, so the real ones in this
    # pytest process are never wrapped.
    class FlatParamHandle:
        def __init__(self, unit: nn.Module) -> None:
            self.flat_param = types.SimpleNamespace(_fqns=("proj.weight", "proj.bias"))
            self._fully_sharded_module = unit

        def unshard(self) -> str | None:
            return torch_fsdp_labels.current_label()  # what a collective issued here is labelled

    monkeypatch.setattr(torch_fsdp_labels, "_done", set())
    monkeypatch.setitem(
        sys.modules, torch_fsdp_labels._FSDP1_HANDLE, types.SimpleNamespace(FlatParamHandle=FlatParamHandle)
    )
    for name in (torch_fsdp_labels._FSDP2, torch_fsdp_labels._FSDP1_RUNTIME):
        monkeypatch.delitem(sys.modules, name, raising=False)
    tracing.begin_test(str(tmp_path / "tracing.jsonl"))
    try:
        model = Model()
        tensor_names.name_tensor(model)  # the unit's path, without a forward
        assert FlatParamHandle(model.unit).unshard() == UNIT_LABEL  # an unshard before any forward
    finally:
        tracing.end_test()
