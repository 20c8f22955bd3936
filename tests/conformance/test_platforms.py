"""Declared platforms (SUPPORTED_PLATFORMS): refused once at session start, and proven for torch FSDP2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pytest
import torch

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import platforms

pytest_plugins = ["pytester"]


class CudaOnly(ReferenceAdapter):
    name = "cuda-only"
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {"cpu": "it needs NCCL"}


class NewTorchOnCpu(ReferenceAdapter):
    name = "new-torch-on-cpu"
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": ">=2.7", "cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {"cpu": "CPU streams have no record_event before 2.7"}


def test_a_device_left_out_is_refused_with_the_reason() -> None:
    assert platforms.unsupported(CudaOnly, "cpu", "2.13.0") == "it does not run on cpu: it needs NCCL"
    assert platforms.unsupported(CudaOnly, "cuda", "2.6.0") is None


def test_a_torch_outside_the_range_is_refused_with_the_reason() -> None:
    why = platforms.unsupported(NewTorchOnCpu, "cpu", "2.6.0+cu124")
    assert why == "on cpu it needs torch >=2.7, this is torch 2.6.0+cu124: CPU streams have no record_event before 2.7"
    assert platforms.unsupported(NewTorchOnCpu, "cpu", "2.7.0") is None
    assert platforms.unsupported(ReferenceAdapter, "cpu", "2.6.0") is None  # the default: everywhere


def test_a_named_backend_is_an_error_one_from_all_is_left_out() -> None:
    adapters = {"cuda-only": CudaOnly, "reference": ReferenceAdapter}
    with pytest.raises(platforms.PlatformRefusal, match=r"backend 'cuda-only' cannot run here: it does not run on cpu"):
        platforms.refused_backends(adapters, ["cuda-only"], ["cpu"], "2.13.0")
    refused = platforms.refused_backends(adapters, [], ["cpu"], "2.13.0")
    assert list(refused) == ["cuda-only"] and "it needs NCCL" in refused["cuda-only"]
    assert platforms.refused_backends(adapters, ["cuda-only"], ["cuda"], "2.13.0") == {}


def test_a_malformed_declaration_is_an_error() -> None:
    class Sloppy(ReferenceAdapter):
        name = "sloppy"
        SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": "2.7+"}

    with pytest.raises(platforms.PlatformRefusal, match=r"backend 'sloppy': SUPPORTED_PLATFORMS .* is not valid"):
        platforms.refused_backends({"sloppy": Sloppy}, [], ["cpu"], "2.13.0")


def test_fsdp2_declares_cpu_exactly_where_cpu_streams_record_events() -> None:
    """The claim behind torch-fsdp2's declaration, on whichever torch runs this: fully_shard on
    CPU records events on torch.cpu.Stream, which has record_event from torch 2.7 on."""
    has_events = hasattr(torch.cpu.Stream(), "record_event")
    declared = platforms.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__) is None
    assert declared == has_events, f"torch {torch.__version__}: record_event {has_events}, CPU declared {declared}"


SCENARIO = """
def test_case(backend):
    pass
"""


def test_the_plugin_refuses_at_session_start(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scenario=SCENARIO)
    target = f"{__name__}:CudaOnly"
    result = pytester.runpytest(
        "-p", "conformance.suite.backend_plugin", "-p", "no:cacheprovider", "--device", "cpu", "--backend", target
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*backend 'cuda-only' cannot run here: it does not run on cpu: it needs NCCL*"])
    assert "test_case" not in result.stdout.str()
