"""The session gate (conformance.suite.gate): a backend runs only on device kinds its declared
platforms (SUPPORTED_PLATFORMS) allow and where it has an API form, refused once at session start
for every kind this session's worlds may get; the torch FSDP2 declaration is proven here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.template import TemplateAdapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.protocol import Capability
from conformance.suite import gate, probe
from harness.config import devices

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]


class CudaOnly(ReferenceAdapter):
    name = "cuda-only"
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {"cpu": "it needs NCCL"}


class NewTorchOnCpu(ReferenceAdapter):
    name = "new-torch-on-cpu"
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": ">=2.7", "cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {"cpu": "CPU streams have no record_event before 2.7"}


def test_a_device_left_out_is_refused_with_the_reason() -> None:
    assert gate.unsupported(CudaOnly, "cpu", "2.13.0") == "it does not run on cpu: it needs NCCL"
    assert gate.unsupported(CudaOnly, "cuda", "2.6.0") is None


def test_a_torch_outside_the_range_is_refused_with_the_reason() -> None:
    why = gate.unsupported(NewTorchOnCpu, "cpu", "2.6.0+cu124")
    assert why == "on cpu it needs torch >=2.7, this is torch 2.6.0+cu124: CPU streams have no record_event before 2.7"
    assert gate.unsupported(NewTorchOnCpu, "cpu", "2.7.0") is None
    assert gate.unsupported(ReferenceAdapter, "cpu", "2.6.0") is None  # the default: everywhere


CPU_RUNNER = gate.SessionDevices(kinds=("cpu",), reachable=True)
GPU_RUNNER_AUTO = gate.SessionDevices(kinds=("cuda", "cpu"), reachable=True)  # a world larger than the GPUs: cpu
GPU_RUNNER_CUDA = gate.SessionDevices(kinds=("cuda",), reachable=True)


class NeedsCudaAtRunTime(TemplateAdapter):
    """Declares every platform but finds out only when built that it needs CUDA: no API form on cpu
    (docs/writing-an-adapter.md, 'Backends that run only on CUDA'). Building it touches no GPU."""

    name = "needs-cuda-at-run-time"

    def capabilities(self) -> frozenset[Capability]:
        if self.env.device.type != "cuda":
            return self.CAPABILITIES - {Capability.WRAPPER, Capability.COMPOSABLE}
        return self.CAPABILITIES


def test_a_named_backend_is_an_error_one_from_all_is_left_out() -> None:
    adapters = {"cuda-only": CudaOnly, "reference": ReferenceAdapter}
    with pytest.raises(gate.BackendRefused, match=r"backend 'cuda-only' cannot run here: it does not run on cpu"):
        gate.refused_backends(adapters, ["cuda-only"], CPU_RUNNER, "2.13.0")
    refused = gate.refused_backends(adapters, [], CPU_RUNNER, "2.13.0")
    assert list(refused) == ["cuda-only"] and "it needs NCCL" in refused["cuda-only"]
    assert gate.refused_backends(adapters, ["cuda-only"], GPU_RUNNER_CUDA, "2.13.0") == {}


def test_every_device_kind_a_world_may_get_is_gated_on_forms_too() -> None:
    """--device auto on a GPU runner: worlds that fit on the GPUs get cuda, larger ones cpu. A
    backend with a form on cuda only is refused for cpu, naming the kind, the backend and the fix."""
    adapters = {"needs-cuda-at-run-time": NeedsCudaAtRunTime, "reference": ReferenceAdapter}
    assert gate.refused_backends(adapters, ["needs-cuda-at-run-time"], GPU_RUNNER_CUDA, "2.13.0") == {}
    refused = gate.refused_backends(adapters, [], GPU_RUNNER_AUTO, "2.13.0")
    assert list(refused) == ["needs-cuda-at-run-time"]  # brought in by `all`: left out, the reason in the header
    why = refused["needs-cuda-at-run-time"]
    assert why.startswith("backend 'needs-cuda-at-run-time' cannot run here: its capabilities() on cpu include ")
    assert "--device" in why and "SUPPORTED_PLATFORMS" in why
    unreachable = gate.SessionDevices(kinds=("cpu",), reachable=False)  # the adapter is not built to ask
    assert gate.refused_backends(adapters, [], unreachable, "2.13.0") == {}


def test_a_malformed_declaration_is_an_error() -> None:
    class Sloppy(ReferenceAdapter):
        name = "sloppy"
        SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": "2.7+"}

    with pytest.raises(gate.BackendRefused, match=r"backend 'sloppy': SUPPORTED_PLATFORMS .* is not valid"):
        gate.refused_backends({"sloppy": Sloppy}, [], CPU_RUNNER, "2.13.0")


def test_fsdp2_declares_cpu_exactly_where_cpu_streams_record_events() -> None:
    """The claim behind torch-fsdp2's declaration, on whichever torch runs this: fully_shard on
    CPU records events on torch.cpu.Stream, which has record_event from torch 2.7 on."""
    has_events = hasattr(torch.cpu.Stream(), "record_event")
    declared = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__) is None
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


def test_a_gpu_runner_with_device_auto_refuses_a_backend_without_a_form_on_cpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two visible GPUs, --device auto: a world of one runs on cuda, a world of four on cpu. The
    backend has a form on cuda only, so the session is refused for cpu before any test is
    collected (it was admitted while only the one-rank world's device was asked)."""
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    pytester.makepyfile(test_scenario=SCENARIO)
    result = pytester.runpytest(
        *("-p", "conformance.suite.backend_plugin", "-p", "no:cacheprovider", "--collect-only"),
        *("--device", "auto", "--backend", f"{__name__}:NeedsCudaAtRunTime"),
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(
        ["*backend 'needs-cuda-at-run-time' cannot run here: its capabilities() on cpu include neither*--device*"]
    )
    assert "test_case" not in result.stdout.str()


_TWO_KIND_GATE = """
import sys

import torch

from conformance.suite import gate, registry

auto_on_a_gpu_runner = gate.SessionDevices(kinds=("cuda", "cpu"), reachable=True)
refused = gate.refused_backends(
    {"deepspeed": registry.load("deepspeed")}, ["deepspeed"], auto_on_a_gpu_runner, torch.__version__
)
print(refused, "deepspeed" in sys.modules)
"""


def test_deepspeed_is_admitted_for_both_kinds_of_an_auto_session_and_pytest_never_imports_it() -> None:
    """DeepSpeed fixes its accelerator at its first import: built for cuda then cpu in one process
    (--device auto on a GPU runner), the second build raised and the backend was refused; and the
    library stayed imported in pytest, with the cuda accelerator, for every forked rank. Each kind
    is now asked of a child of its own (simulated here: building for cuda needs no GPU)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed in this environment (the `test` extra installs it)")
    done = subprocess.run(
        [sys.executable, "-c", _TWO_KIND_GATE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # single-threaded, as the gate's fork wants
    )
    assert done.stdout.split()[-2:] == ["{}", "False"], done.stdout + done.stderr[-3000:]


class _BuildsBadly(ReferenceAdapter):
    """An adapter whose capabilities depend on the device (so the gate builds it) and whose
    constructor fails the way ``how`` says, in the child that builds it."""

    name = "builds-badly"
    how = "raise"

    def __init__(self, env: object) -> None:
        if self.how == "raise":
            raise OSError("no such library: libbackend.so")
        if self.how == "die":
            os.kill(os.getpid(), 9)
        time.sleep(60)

    def capabilities(self) -> frozenset[Capability]:
        return self.CAPABILITIES


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("raise", "failed: OSError: no such library: libbackend.so"),
        ("die", "the child that built it died by signal SIGKILL before answering"),
        ("hang", "building it did not finish within 1 s (the child was killed)"),
    ],
)
def test_an_adapter_that_cannot_be_built_is_refused_with_how_it_failed(
    how: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe, "DEADLINE_S", 1.0)
    monkeypatch.setattr(probe, "_threads", lambda: 1)  # the outer session may have threads: fork anyway
    monkeypatch.setattr(_BuildsBadly, "how", how)
    refused = gate.refused_backends({"builds-badly": _BuildsBadly}, [], CPU_RUNNER, "2.13.0")
    assert said in refused["builds-badly"], refused
