"""The device decision: which device and communication backend a world of N ranks gets.

N ranks get N GPUs with NCCL when this machine has at least N visible GPUs (under torchrun: the
ranks of this host, LOCAL_WORLD_SIZE); otherwise CPU with gloo. Which GPUs a pool gets is
`harness.process.gpu_locks`; how a rank joins its world on its device is `harness.rank.world`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.config.gpu_count import visible_gpu_count
from harness.config.torchrun import TorchrunWorld
from harness.messages import DeviceKind, comm_backend

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DevicePlan:
    kind: DeviceKind | None
    skip_reason: str = ""

    @property
    def comm_backend(self) -> str:
        return comm_backend(self.kind)


def plan_devices(requested: str, world_size: int) -> DevicePlan:
    """Resolve `--device` for one world size; `kind=None` means the test must be skipped."""
    gpus = visible_gpu_count()
    if requested == "cpu":
        return DevicePlan("cpu")
    if requested == "cuda":
        if gpus >= world_size:
            return DevicePlan("cuda")
        return DevicePlan(None, f"needs {world_size} GPUs, found {gpus}")
    if requested == "auto":
        return DevicePlan("cuda" if gpus >= world_size else "cpu")
    raise ValueError(f"unknown device {requested!r}: use one of {', '.join(DEVICE_CHOICES)}")


def plan_world(requested: str, world_size: int, torchrun: TorchrunWorld | None = None) -> DevicePlan:
    """The one device decision of a session: what a world of `world_size` ranks gets.

    `torchrun`: the torchrun world this process is a rank of (`harness.config.torchrun`), if any:
    the world exists already, so only its own size can run, and GPUs are counted per node (a
    2-node world of 8 ranks needs 4 GPUs on each node, not 8).
    """
    if torchrun is None:
        return plan_devices(requested, world_size)
    if world_size != torchrun.world_size:
        return DevicePlan(None, f"needs world size {world_size}; this torchrun world has {torchrun.world_size} ranks")
    return plan_devices(requested, torchrun.local_world_size)


def device_kinds(requested: str, torchrun: TorchrunWorld | None = None) -> tuple[DeviceKind, ...]:
    """The device kinds worlds of a session may get for `--device requested`.

    `auto` gives CUDA to a world that fits on the visible GPUs and CPU to any larger one, so with
    GPUs it may use both; under torchrun there is one world, and its device.
    """
    if requested in ("cpu", "cuda"):
        return (requested,)  # type: ignore[return-value]
    if torchrun is not None:
        return (plan_world(requested, torchrun.world_size, torchrun).kind or "cpu",)
    return ("cuda", "cpu") if visible_gpu_count() else ("cpu",)


@dataclass(frozen=True)
class RunContext:
    """The world size and device the harness chose for one test (`harness.run_context`)."""

    world_size: int | None
    """None for a test without ranks (no `world_size` marker)."""
    device: DeviceKind | None
    """None when the test's world cannot have its devices here (it is skipped: too few GPUs)."""


@dataclass
class DeviceTally:
    """How many distributed tests of a session got their devices and how many could not, so a
    session where none could (`--device cuda` on a runner that lost its GPUs) is not green."""

    requested: str
    got: int = 0
    lacked: dict[str, int] = field(default_factory=dict)  # skip reason -> tests

    def note(self, plan: DevicePlan) -> None:
        if plan.kind is None:
            self.lacked[plan.skip_reason] = self.lacked.get(plan.skip_reason, 0) + 1
        else:
            self.got += 1

    def nothing_ran(self) -> str | None:
        """Why the session must fail, or None: only when tests needed devices and none got them."""
        if self.got or not self.lacked:
            return None
        reasons = "; ".join(f"{count} {reason}" for reason, count in self.lacked.items())
        return (
            f"harness: --device {self.requested}: no distributed test got its devices ({reasons}); "
            "nothing ran, so the run fails: run on a machine with the GPUs or pass --device cpu"
        )
