"""Adapter template: copy this file, rename the class and ``name``, replace the DDP calls.

It is a complete, working adapter for the simplest data-parallel "backend" there is, torch's
``DistributedDataParallel`` (every rank keeps everything; gradients are all-reduced), so it
runs as is and the self-tests keep it honest:

    python -m pytest conformance --backend conformance.adapters.template:TemplateAdapter

Every method of the protocol appears below, the optional ones with their default behaviour
spelled out and a note on when to replace it. The protocol itself is the package
``conformance.protocol``: the defaults copied here are its ``hooks`` module's (``BackendHooks``),
the declared facts its ``facts`` module's (``BackendFacts``), the capabilities and spec conditions
its ``capabilities`` and ``vocabulary`` modules', and the template methods that check a call
before it reaches your ``_shard`` / ``_unshard`` / ... are in its ``adapter`` module. What your
own tests use to prove the facts and gaps you declare is its ``proofs`` module (``FactProofs``,
``AbsenceProofs``).

A backend that owns its training loop (it builds the optimizer itself and runs its own backward
and step, as DeepSpeed does) overrides ``make_optimizer`` / ``backward`` / ``step`` /
``zero_grad``; see ``conformance/adapters/deepspeed/`` for a complete one. The contract each
method must honour is in docs/writing-an-adapter.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    BackendEnv,
    Capability,
    DeferredInit,
    MixedPrecisionUnshard,
    OptimizerFactory,
    ParameterGroups,
    Requirement,
    ShardEvent,
    ShardingSpec,
    ShardLayout,
    StateDictKind,
    UnshardRequest,
    declared_fqn,
)

_FULL = StateDictOptions(full_state_dict=True)


class TemplateAdapter(BackendAdapter):
    # The protocol version this adapter was written for: state yours, so that a later protocol
    # can tell you (one warning) what you do not declare of what it added.
    PROTOCOL_VERSION = 9
    # Test ids, reports and expectations use it. The expectations file is <name>.toml in
    # --expectations-dir when given, else the file EXPECTATIONS names (next to your module), else
    # conformance/expectations/<name>.toml (docs/writing-an-adapter.md, section 8).
    name = "template-ddp"
    # EXPECTATIONS = "expectations.toml"
    # Path components your *wrapper* inserts between the root you return and the user's model
    # (DDP: "module"): scenarios remove exactly these from parameter names and nothing else,
    # so name them all (and only them: every path component so named is dropped).
    WRAPPER_COMPONENTS = frozenset({"module"})
    # Declare only what really works; everything else is skipped as "unsupported: <why>".
    CAPABILITIES = frozenset(
        {
            Capability.WRAPPER,
            Capability.NO_SHARD,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
            Capability.FULL_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
            Capability.NO_SYNC,  # DDP's no_sync(): see no_gradient_sync below
            # Optimizer parameter groups by name: the default make_optimizer_with_groups hands
            # factory the groups of the module's parameters, right for DDP (it steps them).
            Capability.PARAMETER_GROUPS,
        }
    )
    # The reason each missing capability is missing: a claim about the backend, so a true one,
    # and proven on the library by your own tests (conformance.protocol.AbsenceProofs;
    # docs/writing-an-adapter.md, "Proving a declared gap"; examples/zero2-backend does it).
    UNSUPPORTED_REASONS = {
        Capability.COMPOSABLE: "DistributedDataParallel is a wrapper; it has no in-place form",
        Capability.UNITS: "DDP replicates the whole model; it has no sharding units",
        Capability.FULL_SHARD: "DDP shards nothing",
        Capability.SHARDED_STATE_DICT: "DDP shards nothing, so there is no sharded state dict",
    }
    # Features you have one by one but not together, and spec-field values (SpecCondition) you
    # cannot combine with a feature: {frozenset({...}): reason}. DDP: none.
    UNSUPPORTED_COMBINATIONS = {}
    # Backend facts (docs/writing-an-adapter.md, "Backend facts"): leave out what you do as the
    # seeds (torch FSDP1) do. The name of a unit's flat parameter (with FLAT_PARAMETERS):
    FLAT_PARAMETER_NAME = "_flat_param"
    # How your backend refuses each misuse (Misuse -> Refusal(types, message regex)); a misuse
    # left out is held to the seeds' (SEED_REFUSALS). DDP has no unshard to misuse: none.
    REFUSALS = {}
    # Under mixed precision: is unshard() shown in the compute dtype, does the root stay gathered?
    MIXED_PRECISION_UNSHARD = MixedPrecisionUnshard(shows_compute_dtype=False, root_stays_unsharded=False)
    # How parameters are split over the ranks: what local_shard returns and how large a unit's
    # unsharded storage is, both checked exactly (ShardLayout: FLAT_UNIT as FSDP1, ROWS as
    # FSDP2, PER_PARAMETER as DeepSpeed ZeRO-3). DDP splits nothing; with NO_SHARD only, no
    # scenario reads it.
    SHARD_LAYOUT = ShardLayout.FLAT_UNIT
    # Inside unshard(), what your root puts before every original name in named_parameters()
    # and named_buffers(), compared raw (nothing stripped). DDP lists "module.<name>".
    UNSHARDED_NAME_PREFIX = "module"
    # With TENSOR_PARALLEL: where your sharded 2-D state dict puts the values tensor parallelism
    # left whole: "2-D" (the seeds': the 2-D mesh, (Shard(0), Replicate())) or "dp" (the dp mesh,
    # (Shard(0),)). DDP has no 2-D state dict, so the default stands.
    NON_TP_2D_STATE_DICT_MESH = "2-D"
    # The packages of your library (import names): collectives issued from their code are
    # attributed to the scenario line that called into it, the same on every rank, so your
    # library's rank-dependent paths (an owner rank broadcasting, the others receiving) are
    # never taken for the user's divergence. DDP issues its collectives from torch (always
    # skipped): none. DeepSpeed: ("deepspeed",).
    BACKEND_MODULES = ()
    # Where it runs (docs/writing-an-adapter.md, "Devices and torch versions"): device kind -> the
    # torch versions it runs on there ("" for every torch; a kind left out is not supported), and
    # why not where it does not. A session elsewhere refuses the backend once, at start. DDP: anywhere.
    SUPPORTED_PLATFORMS = {"cpu": "", "cuda": ""}
    PLATFORM_REASONS = {}

    def __init__(self, env: BackendEnv) -> None:
        # Built once per test in every rank; the default process group already exists.
        # Libraries that read torchrun's variables (LOCAL_RANK, ...) get them set from `env`
        # here: the harness restores the environment after each test. The session also builds
        # one in the pytest process (rank 0 of a world of one, no process group) to ask
        # capabilities(): keep the constructor free of collectives.
        super().__init__(env)

    # -- what the backend has here: the defaults, spelled out -------------------------------
    def capabilities(self) -> frozenset[Capability]:
        # Override when support depends on self.env (the device): a CUDA-only backend returns
        # no API form on CPU, and the session refuses it at start with what is missing.
        return self.CAPABILITIES

    def unsupported_combinations(self) -> Mapping[frozenset[Requirement], str]:
        return self.UNSUPPORTED_COMBINATIONS

    def mixed_precision_dtypes(self) -> tuple[torch.dtype, ...]:
        # Read only where MIXED_PRECISION is declared: the low-precision dtypes you compute in
        # on self.env.device, preferred first. Ask the backend, not the machine's name: a CPU
        # accelerator may offer float16 only on CPUs with AVX512-FP16 / AMX-FP16 (DeepSpeed's does).
        return (torch.float16, torch.bfloat16)

    def original_fqn(self, name: str) -> str:
        # A name on the sharded model without the WRAPPER_COMPONENTS; scenarios compare names
        # with conformance.protocol.declared_fqn, which an override cannot widen.
        return declared_fqn(self, name)

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def _shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
        # A model built under torch.device("meta") (protocol 9). The default below is right for a
        # backend without deferred initialization; a backend that shards a meta model and
        # materializes it itself calls init.fill (or init.materialize_module) where it does.
        return self._shard(init.materialize(model, self.env.device), spec, form)

    # -- training loop: the defaults, spelled out -------------------------------------------
    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        # Called once, right after shard(). A backend that must own the optimizer builds it
        # here (e.g. passes factory(params) to its engine) and returns what step/zero_grad and
        # the optimizer state dict methods below accept.
        return factory(model.parameters())

    def make_optimizer_with_groups(
        self, model: nn.Module, factory: OptimizerFactory, groups: ParameterGroups
    ) -> torch.optim.Optimizer:
        # Only if you declare PARAMETER_GROUPS: the optimizer over groups chosen by name.
        # groups.split turns (original FQN, parameter) pairs into torch's group dicts; DDP steps
        # the parameters the module exposes, so they are what the groups hold. A backend that
        # builds its optimizer over partitions or an engine's copies hands those the groups.
        named = [(self.original_fqn(name), param) for name, param in model.named_parameters()]
        return factory(groups.split(named))

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()  # DDP all-reduces (averages) gradients in its backward hooks

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        # Only if you declare GRADIENT_CLIPPING: the total norm over every rank, before clipping.
        # DDP's gradients are whole on every rank, so torch's clip is right; a backend storing
        # plain-tensor shards must use its library's own (the local norm is the classic bug).
        return torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    # -- unshard ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        # DDP's parameters are always full: nothing to gather, and changes made inside are
        # made to the stored parameters (they persist whatever `request.writeback` says).
        yield

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return {name: value.detach().clone() for name, value in _inner(model).state_dict().items()}

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        _inner(model).load_state_dict(dict(state_dict))

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        # torch's layout keyed by parameter FQN (docs/writing-an-adapter.md, "State-dict
        # layouts"); torch.distributed.checkpoint builds it for DDP and FSDP models.
        return get_optimizer_state_dict(model, optim, options=_FULL)

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        set_optimizer_state_dict(model, optim, dict(state_dict), options=_FULL)

    # -- native checkpoint (optional, NATIVE_CHECKPOINT): your own sharded save / load --------
    def _save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        # Every rank writes its part under `directory` (one path, shared by the ranks).
        super()._save_checkpoint(model, optim, directory)  # not declared: never called

    def _load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        super()._load_checkpoint(model, optim, directory)

    # -- introspection (optional): declare INTROSPECT_* only where the backend can tell --------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        # Whether the unit at FQN `unit` holds unsharded storage now (INTROSPECT_UNSHARDED).
        return super().is_unsharded(model, unit)  # not declared: the base class skips

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        # Elements of unsharded parameter storage the unit holds allocated now, every copy
        # counted: 0 once freed, the SHARD_LAYOUT's padded size while unsharded
        # (INTROSPECT_STORAGE). Read it from the storage itself (untyped_storage().nbytes()),
        # not from a flag: an unfreed buffer must show.
        return super().unsharded_storage_numel(model, unit)

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        # Unit FQN -> FQNs of the parameters it manages (INTROSPECT_UNIT_FQNS).
        return super().unit_fqns(model)

    def record_events(self, model: nn.Module) -> contextlib.AbstractContextManager[list[ShardEvent]]:
        # A context yielding a list that fills with ShardEvent("unshard"/"reshard", unit FQN)
        # in the order the units change state (INTROSPECT_EVENTS).
        return super().record_events(model)

    # -- storage: the defaults fit (the parameter is what a rank stores) --------------------
    # Override these when a rank's part of a parameter lives somewhere else than `param`
    # (DeepSpeed ZeRO-3: `param.ds_tensor`) or is also kept elsewhere (an optimizer's fp32
    # master copy). `fqn` is an original FQN (original_fqn of a name on the sharded model).
    def local_shard(self, model: nn.Module, fqn: str) -> torch.Tensor:
        return super().local_shard(model, fqn)  # a copy of param (or its DTensor local shard)

    def set_local_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        super().set_local_shard(model, fqn, value)

    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        return super().local_grad_shard(model, fqn)

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        super().set_local_grad_shard(model, fqn, value)

    def local_optim_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fqn: str
    ) -> dict[str, torch.Tensor]:
        # The optimizer-state tensors this rank stores for the parameter (Adam: exp_avg,
        # exp_avg_sq), scalars such as `step` left out; {} where another rank keeps them. The
        # storage scenario sums them over the ranks against the strategy's claim (NO_SHARD:
        # whole on every rank). Override where the state lives elsewhere (a partitioning
        # optimizer's inner optimizer, flat fp32 partitions).
        return super().local_optim_state(model, optimizer, fqn)

    # -- gradient accumulation (NO_SYNC) --------------------------------------------------------
    def no_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        # Micro-batches run forward and backward inside, accumulating local gradients without
        # reducing them; the first backward after the context reduces the whole sum. DDP decides
        # in forward whether the next backward reduces, which is why forward runs inside too.
        return model.no_sync()

    # -- labels and lifetime: the defaults fit ----------------------------------------------
    def collective_label(self) -> str | None:
        # Return the FQNs a collective carries while the backend issues it (wrap the backend's
        # gather / reduce entry points and publish the names in a contextvars.ContextVar, as
        # conformance/adapters/_labels.py does). DDP's gradient buckets mix parameters, so the
        # harness's default (the running module's FQN) is kept.
        return None

    def close(self) -> None:
        # Drop what the backend caches across tests (process groups in module globals, ...).
        return None


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
