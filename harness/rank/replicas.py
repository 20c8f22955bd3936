"""Replica checksums on a rank: which tensors a strategy keeps replicated, over which group, and
their digests (`harness.trace.checksums` holds the data and the comparison across ranks).

Which tensors are replicated, and over which group (global ranks), by the structures a model has:

  * a module wrapped by DDP (`torch.nn.parallel.DistributedDataParallel`): the parameters of its
    `.module` over `ddp.process_group`, except `parameters_to_ignore`; its buffers too when
    `broadcast_buffers=False` (DDP then never syncs them); with `broadcast_buffers=True` DDP
    broadcasts rank 0's buffers at each forward, and a buffer the forward updates (BatchNorm's
    statistics) legitimately differs afterwards, so buffers are not compared;
  * a DTensor (FSDP2, tensor parallelism): its local tensor, over the ranks that share its mesh
    coordinates but on the mesh dimensions whose placement is `Replicate()` (HSDP's replicate
    dimension, a tensor-parallel replicated parameter); one with no `Replicate()` dimension is
    never compared;
  * torch FSDP1 (`FullyShardedDataParallel`): a NO_SHARD unit's flat parameter over the unit's
    process group, a HYBRID_SHARD unit's shard over its inter-node (replicate) group; FULL_SHARD
    and SHARD_GRAD_OP shards never;
  * DeepSpeed ZeRO-3 partitioned parameters (`ds_tensor`): never.

Plain tensors outside those structures are the hard case: a sharding backend of a shape the
harness has not seen (the reference engine in engine/ among them) may store plain-tensor shards
that legitimately differ by rank. They are compared only on evidence that they are replicated:

  * modules the user names, `check_replicas(model, group)` (one all-gather, then raises
    `ReplicaDrift` on every rank) or `replicated(model, group)` (compared after the test): every
    plain parameter and buffer, over `group` (default: the world), when the module has none of
    the structures above (a structured module's plain tensors are FSDP's unsharded parameters or
    its unsynced buffers);
  * in the automatic check (the `check_replicas` marker, `--check-replicas`), a plain parameter
    of a plain root module whose gradient this rank all-reduced whole (an in-place `all_reduce`
    in this test's collective trace naming `<fqn>.grad`, with the parameter's numel), over that
    all-reduce's group: the hand-written data-parallel loop. A shard's gradient is reduce-scattered,
    a flat or bucketed gradient carries no parameter's name (`harness.rank.tensor_names`), so a
    backend's shards are never compared; the one false verdict left would be a gradient summed
    over ranks whose parameters are meant to differ, which no data-parallel scheme does.

Which models (automatic check): the root modules whose forward ran during the test (a global
forward pre-hook, outermost calls only, registered while the check is on), kept alive until the
check runs after the body, and those passed to `replicated`; a root that is a submodule of
another is dropped. History: a global `torch.optim` step pre-hook takes the digests before the
first optimizer step and a post-hook after each (an optimizer stepping another inside its own
step counts once), so the parent can say at which step a drift first appeared.

Nothing here issues a collective except `check_replicas`: after a test body the digests are
computed locally and travel to the parent in the rank's `RankOutcome`, so a rank whose body
failed never leaves its peers waiting.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as nn_module
from torch import nn
from torch.optim import optimizer as torch_optimizer

from harness.rank import tensor_names
from harness.trace.checksums import (
    MAX_STEPS,
    ReplicaDrift,
    ReplicaReport,
    ReplicaSnapshot,
    TensorChecksum,
    comparison,
)
from harness.trace.records import read_trace_or_empty

__all__ = [
    "ReplicaDrift",
    "ReplicaRecorder",
    "active_recorder",
    "begin_test",
    "check_replicas",
    "end_test",
    "replicated",
    "snapshot",
]

_FSDP1_ONE_RANK = (
    "torch FSDP1 runs HYBRID_SHARD on a shard group of one rank as NO_SHARD over that group and reduces no "
    "gradient across the replicate group (pytorch/pytorch#154888): give each shard group two or more ranks, "
    "or use FSDP2's HSDP"
)

# In-place all-reduces whose result is the tensor itself: evidence that a gradient is the same on
# every member afterwards (a functional all-reduce's input is left as it was).
_REDUCING_OPS = frozenset({"all_reduce", "all_reduce_coalesced"})
_EXPLICIT_RULE = "named replicated by the test"
_EVIDENCE_RULE = "its gradient was all-reduced whole"

Ranks = tuple[int, ...]


@dataclass
class _Candidate:
    """A tensor a rank may compare, with why and over which group (None: a plain parameter of a
    plain root, decided by the evidence in the trace)."""

    key: str
    fqn: str
    """Its FQN as messages show it, before the wrappers' segments are dropped."""
    suffix: str
    """What tells its root apart where there are several: " (in Linear#1)"."""
    kind: str
    rule: str
    group: Ranks | None
    tensor: torch.Tensor
    cause: str = ""


@dataclass
class _Root:
    module: nn.Module
    key: str
    """The root's class and its position among the roots of that class: "Linear#0"."""
    group: Ranks | None = None
    """Named replicated over these ranks (`replicated`, `check_replicas`); None: not named."""
    named_by: str = ""


class _Depth(threading.local):
    def __init__(self) -> None:
        self.forwards = 0


# ------------------------------------------------------------------------------- the recorder


class ReplicaRecorder:
    """Watches one test (or script): the roots whose forward runs, the modules named
    `replicated`, and the replicated tensors' digests at each optimizer step; `finish` gives
    this rank's `ReplicaSnapshot`. `start` registers its global hooks, `stop` removes them and
    drops every reference to the test's modules."""

    def __init__(self, trace_path: str | None = None) -> None:
        self.trace_path = trace_path
        self.roots: list[_Root] = []
        self._by_id: dict[int, _Root] = {}
        self._per_class: dict[str, int] = {}
        self._depth = _Depth()
        self._handles: list[Any] = []
        self._optimizers: list[int] = []  # the optimizers whose step is running, outermost first
        self.steps: list[tuple[list[str], _Stacked]] = []
        self.steps_cut = False
        self.notes: list[str] = []
        self.result: ReplicaSnapshot | None = None

    # -- hooks ------------------------------------------------------------------------------
    def start(self) -> ReplicaRecorder:
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._forward_starts),
            nn_module.register_module_forward_hook(self._forward_ends, always_call=True),
            torch_optimizer.register_optimizer_step_pre_hook(self._step_starts),
            torch_optimizer.register_optimizer_step_post_hook(self._step_ends),
        ]
        return self

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.roots, self._by_id, self.steps, self._optimizers = [], {}, [], []

    def _forward_starts(self, module: nn.Module, _inputs: object) -> None:
        depth = self._depth
        if depth.forwards == 0 and id(module) not in self._by_id:
            self.add_root(module)
        depth.forwards += 1

    def _forward_ends(self, _module: nn.Module, _inputs: object, _output: object) -> None:
        depth = self._depth
        depth.forwards = max(0, depth.forwards - 1)

    def _step_starts(self, optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        if id(optimizer) in self._optimizers:  # a step of it raised earlier, and its post-hook never ran
            del self._optimizers[self._optimizers.index(id(optimizer)) :]
        if not self._optimizers and not self.steps:
            self._record_step()  # before the first step
        self._optimizers.append(id(optimizer))

    def _step_ends(self, optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        if id(optimizer) in self._optimizers:
            del self._optimizers[self._optimizers.index(id(optimizer)) :]
        if not self._optimizers:
            self._record_step()

    def _record_step(self) -> None:
        if len(self.steps) > MAX_STEPS:
            self.steps_cut = True
            return
        try:  # inside the user's optimizer step: never break it
            candidates = list(self._candidates(evidence=None))
            self.steps.append(([c.key for c in candidates], _stacked_bits([c.tensor for c in candidates])))
        except Exception as error:  # noqa: BLE001 - the check is never worth failing a step; said in the snapshot
            self._note(f"a step's digests could not be taken ({type(error).__name__}: {error})")

    # -- roots ------------------------------------------------------------------------------
    def add_root(self, module: nn.Module, group: Ranks | None = None, named_by: str = "") -> _Root:
        root = self._by_id.get(id(module))
        if root is None:
            name = type(module).__name__
            position = self._per_class.get(name, 0)
            self._per_class[name] = position + 1
            root = _Root(module, f"{name}#{position}")
            self.roots.append(root)
            self._by_id[id(module)] = root
        if named_by:
            root.group, root.named_by = group, named_by
        return root

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _candidates(self, evidence: dict[tuple[str, int], Ranks] | None) -> Iterator[_Candidate]:
        roots = _outermost(self.roots)
        several = len(roots) > 1
        for root in roots:
            yield from _root_candidates(root, several, evidence)

    # -- the end ----------------------------------------------------------------------------
    def finish(self, rank: int | None = None) -> ReplicaSnapshot:
        """This rank's snapshot: the final digests of every tensor it takes as replicated, and
        their step history. Never raises (what it could not read is in the snapshot's note)."""
        rank = _rank() if rank is None else rank
        try:
            evidence = _evidence(self.trace_path) if self._needs_evidence() else {}
            candidates = [c for c in self._candidates(evidence) if c.group is not None]
            tensors = _checksums(candidates)
            steps = self._history(set(tensors))
        except Exception as error:  # noqa: BLE001 - a check that cannot run says so; it fails nothing
            self._note(f"the replicas could not be digested ({type(error).__name__}: {error})")
            tensors, steps = {}, []
        self.result = ReplicaSnapshot(rank, tensors, steps, self.steps_cut, "; ".join(self.notes))
        return self.result

    def _needs_evidence(self) -> bool:
        return self.trace_path is not None and any(
            root.group is None and not _structured(root.module) for root in _outermost(self.roots)
        )

    def _history(self, keys: set[str]) -> list[dict[str, int]]:
        history = []
        for step_keys, bits in self.steps:
            values = _unstacked(bits, len(step_keys))
            history.append({key: value for key, value in zip(step_keys, values) if key in keys})
        return history


_active: ReplicaRecorder | None = None


def begin_test(trace_path: str | None = None) -> ReplicaRecorder:
    """Start the automatic check of one test on this rank (ends one left open)."""
    global _active
    if _active is not None:
        _active.stop()
    _active = ReplicaRecorder(trace_path).start()
    return _active


def end_test() -> ReplicaSnapshot | None:
    """Stop the check: its hooks removed, its references to the test's modules dropped; the
    snapshot `ReplicaRecorder.finish` took (None when it never ran, e.g. the body's setup failed)."""
    global _active
    recorder, _active = _active, None
    if recorder is None:
        return None
    recorder.stop()
    return recorder.result


def active_recorder() -> ReplicaRecorder | None:
    return _active


# --------------------------------------------------------------------------- the public calls


def replicated(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Declare `module` replicated over `group` (default: the world) for the automatic check of
    the running test: its plain parameters and buffers are compared after the body, without a
    collective. Outside a checked test (no `check_replicas` marker or `--check-replicas`) it does
    nothing; `check_replicas` checks at once, anywhere."""
    if _active is not None:
        _active.add_root(module, _group_ranks(group), "harness.replicated")


def snapshot(modules: nn.Module | Iterable[nn.Module], group: dist.ProcessGroup | None = None) -> ReplicaSnapshot:
    """This rank's digests of what `modules` keep replicated (the structures' rules, and every
    plain tensor of a module with none of them, over `group`, default the world), with the step
    history of the running automatic check when it watched them. Local: no collective. Compare
    the ranks' snapshots with `harness.trace.checksums.compare` (a snapshot's `to_dict()` is
    JSON-able, for a caller that collects them through files)."""
    module_list = [modules] if isinstance(modules, nn.Module) else list(modules)
    ranks = _group_ranks(group)
    recorder = _active
    watched = recorder is not None and all(id(module) in recorder._by_id for module in module_list)
    if recorder is not None and watched:
        roots = [recorder._by_id[id(module)] for module in module_list]
    else:
        counts: dict[str, int] = {}
        roots = []
        for module in module_list:
            name = type(module).__name__
            roots.append(_Root(module, f"{name}#{counts.get(name, 0)}"))
            counts[name] = counts.get(name, 0) + 1
    named = [_Root(root.module, root.key, ranks, "harness.check_replicas") for root in roots]
    several = len(named) > 1
    notes: list[str] = []
    try:
        candidates = [c for root in named for c in _root_candidates(root, several, {}) if c.group is not None]
        tensors = _checksums(candidates)
    except Exception as error:  # noqa: BLE001 - said in the snapshot, as for the automatic check
        notes.append(f"the replicas could not be digested ({type(error).__name__}: {error})")
        tensors = {}
    steps: list[dict[str, int]] = []
    cut = False
    if recorder is not None and watched:
        steps, cut = recorder._history(set(tensors)), recorder.steps_cut
    return ReplicaSnapshot(_rank(), tensors, steps, cut, "; ".join(notes))


def check_replicas(model: nn.Module, group: dist.ProcessGroup | None = None) -> ReplicaReport:
    """Compare what `model` keeps replicated across the ranks of `group` (default: the world),
    now: call it on every rank of `group`, in a test or in a plain torchrun script. One
    `all_gather_object` of the ranks' digests; raises `ReplicaDrift` with the same message on
    every rank when replicas differ (each tensor's FQN, each rank's value, the first optimizer
    step it differed at when the running test's automatic check recorded steps), else returns
    the `ReplicaReport` (how many tensors were compared). A module with none of the structures
    the rules know (DDP, DTensor, FSDP1) is taken as replicated whole: every parameter and buffer."""
    mine = snapshot(model, group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine.to_dict(), group=group)
    report = comparison({int(data["rank"]): data for data in gathered})
    if report.drift is not None:
        raise ReplicaDrift(report.drift)
    return report


# ------------------------------------------------------------------------------------- rules


def _root_candidates(root: _Root, several: bool, evidence: dict[tuple[str, int], Ranks] | None) -> Iterator[_Candidate]:
    """Every tensor of `root` a rank may compare. `evidence` (grad name, numel) -> group decides a
    plain root's parameters in the automatic check; None takes every one as a candidate of no
    group yet (a step's history, pruned at the end)."""
    module = root.module
    structures, tensors = _walk(module)
    structured = bool(structures) or any(_is_dtensor(t) or _is_partitioned(t) for _, _, _, t in tensors)
    prefix, suffix = f"{root.key}/", f" (in {root.key})" if several else ""

    for path, kind, owner in structures:
        if kind == "fsdp1":
            found = _fsdp1_flat_parameter(path, owner)
            if found is not None:
                fqn, description, rule, group, tensor, cause = found
                yield _Candidate(prefix + fqn, fqn, suffix, description, rule, group, tensor, cause)
    for fqn, module_path, kind, tensor in tensors:
        if _is_dtensor(tensor):
            found_dtensor = _dtensor_group(tensor)
            if found_dtensor is not None:
                group, rule = found_dtensor
                yield _Candidate(prefix + fqn, fqn, suffix, kind, rule, group, _local_tensor(tensor))
            continue
        if structures:
            owner = _owner(module_path, structures)
            if owner is not None:
                path, structure, ddp = owner
                if structure == "ddp" and not _is_partitioned(tensor):
                    found_ddp = _ddp_rule(fqn, path, kind, ddp)
                    if found_ddp is not None:
                        shown, rule, group = found_ddp
                        yield _Candidate(prefix + fqn, shown, suffix, kind, rule, group, tensor)
                continue  # FSDP1's and FSDP2's own tensors: their flat parameters and DTensors above
        if structured:
            continue  # a structured model's plain tensors: unsharded parameters, unsynced buffers, partitions
        if root.group is not None:
            yield _Candidate(prefix + fqn, fqn, suffix, kind, f"{_EXPLICIT_RULE} ({root.named_by})", root.group, tensor)
        elif kind == "parameter":
            group = evidence.get((_grad_name(module, fqn), tensor.numel())) if evidence else None
            yield _Candidate(prefix + fqn, fqn, suffix, kind, _EVIDENCE_RULE, group, tensor)


def _walk(module: nn.Module) -> tuple[list[tuple[str, str, nn.Module]], list[tuple[str, str, str, torch.Tensor]]]:
    """One pass over `module`'s tree: (every DDP, FSDP1 and FSDP2 module in it as (raw path,
    "ddp" | "fsdp1" | "fsdp2", module), innermost first (the longest path first, for `_owner`);
    every parameter and buffer, each tensor once, as (raw FQN, its module's raw path,
    "parameter" | "buffer", tensor)). Raw: as registered, without the renaming FSDP1's own
    `named_parameters` applies, so that paths match `named_modules`."""
    ddp = torch.nn.parallel.DistributedDataParallel
    fsdp1 = _loaded("torch.distributed.fsdp", "FullyShardedDataParallel")
    fsdp2 = _loaded("torch.distributed.fsdp", "FSDPModule") or _loaded(
        "torch.distributed._composable.fsdp", "FSDPModule"
    )
    structures: list[tuple[str, str, nn.Module]] = []
    tensors: list[tuple[str, str, str, torch.Tensor]] = []
    seen: set[int] = set()
    for path, sub in module.named_modules():
        if isinstance(sub, ddp):
            structures.append((path, "ddp", sub))
        elif fsdp1 is not None and isinstance(sub, fsdp1):
            structures.append((path, "fsdp1", sub))
        elif fsdp2 is not None and isinstance(sub, fsdp2):
            structures.append((path, "fsdp2", sub))
        dot = f"{path}." if path else ""
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    tensors.append((dot + name, path, kind, tensor))
    structures.sort(key=lambda entry: -len(entry[0]))
    return structures, tensors


def _owner(module_path: str, structures: list[tuple[str, str, nn.Module]]) -> tuple[str, str, nn.Module] | None:
    for entry in structures:
        path = entry[0]
        if not path or module_path == path or module_path.startswith(path + "."):
            return entry
    return None


def _ddp_rule(fqn: str, path: str, kind: str, ddp: nn.Module) -> tuple[str, str, Ranks] | None:
    inner = fqn[len(path) + 1 :] if path else fqn
    inner = inner.removeprefix("module.")  # DDP's own segment: FQNs as the wrapped module names them
    if inner in getattr(ddp, "parameters_to_ignore", ()):
        return None
    if kind == "buffer" and getattr(ddp, "broadcast_buffers", True):
        return None  # DDP syncs rank 0's at each forward; one the forward updates differs after it
    rule = "DDP" if kind == "parameter" else "DDP with broadcast_buffers=False, which never syncs buffers"
    shown = f"{path}.{inner}" if path else inner
    return shown, rule, _group_ranks(getattr(ddp, "process_group", None))


def _fsdp1_flat_parameter(path: str, unit: nn.Module) -> tuple[str, str, str, Ranks, torch.Tensor, str] | None:
    handle = getattr(unit, "_handle", None)
    flat = getattr(handle, "flat_param", None)
    strategy = getattr(getattr(unit, "sharding_strategy", None), "name", "")
    if flat is None:
        return None
    fqns = list(getattr(flat, "_fqns", ()))
    held = ", ".join(fqns[:4]) + (", ..." if len(fqns) > 4 else "")
    description = f"flat parameter of {held}" if held else "flat parameter"
    fqn = f"{path}._flat_param" if path else "_flat_param"
    replicate = getattr(unit, "_inter_node_pg", None)  # set for the hybrid strategies only
    shards = _group_ranks(getattr(unit, "process_group", None))
    if strategy == "NO_SHARD" and replicate is None:
        return fqn, description, "FSDP1 NO_SHARD", shards, flat, ""
    if strategy == "NO_SHARD":
        # HYBRID_SHARD on a shard group of one rank, which FSDP1 runs as NO_SHARD over that group:
        # it then reduces no gradient across the replicate group, whose replicas were asked for.
        rule = "FSDP1 HYBRID_SHARD on a shard group of one rank (run as NO_SHARD), its replicate group"
        return fqn, description, rule, tuple(sorted({*shards, *_group_ranks(replicate)})), flat, _FSDP1_ONE_RANK
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and replicate is not None:
        shard = getattr(flat, "_local_shard", None)
        tensor = shard if isinstance(shard, torch.Tensor) and shard.numel() else flat
        return (
            fqn,
            f"{description}, this rank's shard",
            f"FSDP1 {strategy} replicate group",
            _group_ranks(replicate),
            tensor,
        )
    return None  # FULL_SHARD, SHARD_GRAD_OP: shards


def _dtensor_group(tensor: Any) -> tuple[Ranks, str] | None:
    """The ranks a DTensor's local tensor is replicated over: those sharing this rank's mesh
    coordinates on every dimension whose placement is not `Replicate()`."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    dims = [dim for dim, placement in enumerate(tensor.placements) if placement.is_replicate()]
    if not dims:
        return None
    index = tuple(slice(None) if dim in dims else coordinate[dim] for dim in range(mesh.ndim))
    ranks = tuple(int(rank) for rank in mesh.mesh[index].reshape(-1).tolist())
    names = getattr(mesh, "mesh_dim_names", None)
    shown = ", ".join(f"{dim} ({names[dim]!r})" if names else str(dim) for dim in dims)
    return ranks, f"DTensor Replicate() on mesh dim{'s' * (len(dims) > 1)} {shown}"


def _grad_name(root: nn.Module, fqn: str) -> str:
    """The name the collective trace gives the gradient of `root`'s parameter `fqn`."""
    prefix = tensor_names.module_path(root)
    return ".".join(filter(None, [prefix, tensor_names.strip_path_components(fqn)])) + ".grad"


def _evidence(trace_path: str | None) -> dict[tuple[str, int], Ranks]:
    """(tensor name, numel) -> the group of the last in-place all-reduce of this rank's trace that
    carried it whole."""
    found: dict[tuple[str, int], Ranks] = {}
    if trace_path is None:
        return found
    for record in read_trace_or_empty(trace_path):
        if record.op not in _REDUCING_OPS or record.skipped or not record.member:
            continue
        for position, name in enumerate(record.tensors):
            if name and position < len(record.shapes):
                found[(name, math.prod(record.shapes[position]))] = tuple(record.group)
    return found


def _structured(module: nn.Module) -> bool:
    structures, tensors = _walk(module)
    return bool(structures) or any(_is_dtensor(t) or _is_partitioned(t) for _, _, _, t in tensors)


def _is_partitioned(tensor: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: this rank's partition is `ds_tensor`."""
    return hasattr(tensor, "ds_tensor") or hasattr(tensor, "ds_id")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
        return False
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def _local_tensor(tensor: Any) -> torch.Tensor:
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


def _loaded(module: str, name: str) -> type | None:
    """A class of a torch module already imported (a model cannot hold one of a module never imported)."""
    found = sys.modules.get(module)
    value = getattr(found, name, None) if found is not None else None
    return value if isinstance(value, type) else None


def _outermost(roots: list[_Root]) -> list[_Root]:
    """The roots that are no submodule of another root (a unit called on its own inside a model)."""
    if len(roots) < 2:
        return list(roots)
    inside: set[int] = set()
    for root in roots:
        inside.update(id(sub) for sub in root.module.modules() if sub is not root.module)
    return [root for root in roots if id(root.module) not in inside or root.group is not None]


# ----------------------------------------------------------------------------------- digests


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_ranks(group: Any) -> Ranks:
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(int(rank) for rank in dist.get_process_group_ranks(group))


def _integers(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a 1-D integer tensor: 8 bytes a value where its size allows, else 4, 2
    or 1 (the width depends on the dtype and numel alone, so equal replicas read alike whatever
    their storage offset)."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    size = flat.numel() * flat.element_size()
    width = next(w for w in (8, 4, 2, 1) if (size % w == 0 and w >= flat.element_size()) or w == 1)
    if not flat.is_contiguous() or (flat.storage_offset() * flat.element_size()) % width:
        flat = flat.clone()
    return flat.view(_INTEGERS[width])


_INTEGERS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`TensorChecksum.bits` as a 0-dim int64 tensor on the tensor's device: a sum of 8-byte
    integers wraps around (exact modulo 2**64, so the order a reduction adds in does not matter;
    the fast path, ~10 GB/s on one CPU core), narrower ones are summed into int64."""
    integers = _integers(tensor)
    return integers.sum() if integers.dtype == torch.int64 else integers.sum(dtype=torch.int64)


_Stacked = list[tuple[list[int], torch.Tensor]]
"""A step's bits: per device, the positions of its tensors and their bits stacked (one tensor
per device and step; read once, at the end: no sync per step)."""


def _stacked_bits(tensors: list[torch.Tensor]) -> _Stacked:
    by_device: dict[torch.device, list[int]] = {}
    for position, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(position)
    return [(positions, torch.stack([_bit_sum(tensors[p]) for p in positions])) for positions in by_device.values()]


def _unstacked(stacked: _Stacked, count: int) -> list[int]:
    values = [0] * count
    for positions, bits in stacked:
        for position, value in zip(positions, bits.cpu().tolist()):
            values[position] = int(value)
    return values


def _to_host(values: list[torch.Tensor]) -> list[Any]:
    """Python numbers of 0-dim tensors, one transfer per device."""
    out: list[Any] = [None] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(values):
        by_device.setdefault(value.device, []).append(position)
    for positions in by_device.values():
        stacked = torch.stack([values[p] for p in positions]).cpu().tolist()
        for position, number in zip(positions, stacked):
            out[position] = number
    return out


def _checksums(candidates: list[_Candidate]) -> dict[str, TensorChecksum]:
    bits, sums = [], []
    for c in candidates:
        bits.append(_bit_sum(c.tensor))
        values = c.tensor.detach()
        if values.is_complex():
            values = torch.view_as_real(values)
        values = values.reshape(-1).to(torch.float64)
        sums.append(torch.stack([values.sum(), torch.dot(values, values)]))
    bit_values, sum_values = _to_host(bits), _to_host(sums)
    return {
        c.key: TensorChecksum(
            c.key,
            tensor_names.strip_path_components(c.fqn) + c.suffix,
            c.kind,
            c.rule,
            c.group or (),
            str(c.tensor.dtype).removeprefix("torch."),
            tuple(c.tensor.shape),
            int(bit),
            float(total),
            float(squares),
            c.cause,
        )
        for c, bit, (total, squares) in zip(candidates, bit_values, sum_values)
    }
