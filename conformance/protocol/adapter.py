"""The adapter base class: the public methods scenarios call, and the adoption of older adapters.

:class:`BackendAdapter` joins an adapter's declarations (:class:`BackendFacts`,
:class:`BackendCapabilities`) and optional hooks (:class:`BackendHooks`) with the template
methods: each public method (``shard``, ``unshard``, the state dicts, the native checkpoint)
checks every capability the call exercises, then calls the adapter's implementation (``_shard``,
``_unshard``, ...; :data:`TEMPLATE_METHODS`). An adapter written for a protocol before version 3
implemented the public methods itself; its methods are adopted as the implementations when its
class is created (:func:`_adopt_implementations`), under names of the protocol's own so that
they never collide with the adapter's helpers, and its parameter lookup sees through the
wrapper it could not yet declare (:func:`_adopt_name_lookup`).
"""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.nn as nn

from conformance.protocol.capabilities import BackendCapabilities, require, require_all, unshard_capabilities
from conformance.protocol.facts import BackendFacts
from conformance.protocol.hooks import BackendHooks
from conformance.protocol.vocabulary import (
    ApiForm,
    BackendEnv,
    Capability,
    DeferredInit,
    Requirement,
    ShardEvent,
    ShardingSpec,
    StateDictKind,
    UnshardRequest,
)

# The protocol version from which ``_unshard`` takes one UnshardRequest (before: keyword options).
UNSHARD_REQUEST_VERSION = 6

# The public methods that check the declared capabilities, then call the adapter's
# implementation: public name -> the method an adapter implements.
TEMPLATE_METHODS = {
    "shard": "_shard",
    "shard_deferred": "_shard_deferred",
    "unshard": "_unshard",
    "state_dict": "_state_dict",
    "load_state_dict": "_load_state_dict",
    "optim_state_dict": "_optim_state_dict",
    "load_optim_state_dict": "_load_optim_state_dict",
    "save_checkpoint": "_save_checkpoint",
    "load_checkpoint": "_load_checkpoint",
}


class BackendAdapter(BackendFacts, BackendCapabilities, BackendHooks, abc.ABC):
    """Base class of every adapter. Subclasses set ``name`` and ``CAPABILITIES``.

    Every ``model`` argument is the module :meth:`shard` returned. Module FQNs in arguments
    and results are always those of the *original* model (no wrapper prefixes), so a scenario
    is written once for every backend.

    What an adapter declares lives in the bases, by concern: its facts (:class:`BackendFacts`:
    names, refusals, shard layout), its capabilities (:class:`BackendCapabilities`: capabilities,
    unsupported reasons and combinations, platforms) and its optional hooks with plain-torch
    defaults (:class:`BackendHooks`: training loop, storage, collective label, close). This class
    holds who the adapter is and the methods scenarios call to shard, unshard, save and look inside.
    """

    # The backend's name: test ids, reports, the matrix column and the expectations file use it.
    name: ClassVar[str]
    # The protocol version this adapter was written for; unstated means the first.
    PROTOCOL_VERSION: ClassVar[int] = 1
    # The adapter's own expected-failure file (conformance.suite.expectations): a path relative to the
    # file of the module that sets it, e.g. "expectations.toml" next to the adapter module, so
    # a package registered as an entry point ships its known failures with it.
    EXPECTATIONS: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Adoption first, then the bases' checks (BackendCapabilities: an API form is declared),
        # the order they have always run in.
        _adopt_implementations(cls)
        _adopt_name_lookup(cls)
        super().__init_subclass__(**kwargs)

    def __init__(self, env: BackendEnv) -> None:
        self.env = env

    # -- applying sharding ----------------------------------------------------------------
    # The public methods below check every capability the call exercises (a missing one skips
    # the test as "unsupported: ...", never runs it half-supported), then call the adapter's
    # implementation (the underscored abstract method). An adapter implements those and never
    # repeats the checks: a forgotten refusal cannot happen.

    def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        """Shard ``model`` (already on ``env.device``) and return the module to run, after
        checking ``spec.needed_capabilities(form)`` and the declared combinations."""
        require_all(self, spec.needed_capabilities(form) | spec.conditions())
        sharded = _implementation(self, "shard")(model, spec, form)
        self._specs()[sharded] = spec
        return sharded

    def shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
        """:meth:`shard` for a model built on the meta device (protocol 9): the result holds
        every parameter and buffer on ``env.device``, with the values ``init`` fills in, sharded
        as ``spec`` says. Checks what :meth:`shard` checks, then calls ``_shard_deferred``."""
        require_all(self, spec.needed_capabilities(form) | spec.conditions())
        sharded = _implementation(self, "shard_deferred")(model, spec, form, init)
        self._specs()[sharded] = spec
        return sharded

    def _shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
        """Materialize and shard a meta-device ``model``. Default: what a user of a backend with
        no deferred initialization does, ``init.materialize(model, env.device)`` (every module
        given storage and filled), then ``_shard``. A backend that shards a meta model and
        materializes it itself (FSDP1's ``param_init_fn``, FSDP2's ``fully_shard`` then
        ``to_empty``) overrides this, so the scenarios check its own mechanism."""
        return _implementation(self, "shard")(init.materialize(model, self.env.device), spec, form)

    def _specs(self) -> weakref.WeakKeyDictionary[nn.Module, ShardingSpec]:
        """The spec each module :meth:`shard` returned was sharded with (for the combinations
        a later call on it completes, e.g. an optimizer state dict of a model with original
        parameters)."""
        specs = self.__dict__.get("_sharded_with")
        if specs is None:
            specs = self.__dict__["_sharded_with"] = weakref.WeakKeyDictionary()
        return specs

    def _spec_requirements(self, model: nn.Module) -> set[Requirement]:
        spec = self._specs().get(model)
        return set() if spec is None else spec.feature_capabilities() | spec.conditions()

    @abc.abstractmethod
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        """Shard ``model`` (already on ``env.device``) and return the module to run.

        The wrapper form returns the root wrapper; the composable form returns ``model``
        itself (sharded in place). The result's ``parameters()`` are what the optimizer gets.
        Every capability the spec uses is declared (:meth:`shard` checked).
        """

    # -- unshard ------------------------------------------------------------------------
    @contextlib.contextmanager
    def unshard(
        self,
        model: nn.Module,
        fqn: str = "",
        *,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Context in which the submodule at ``fqn`` ("" = root) exposes full parameters, after
        checking the capabilities these options exercise (:func:`unshard_capabilities`); the
        options reach the adapter's ``_unshard`` as one :class:`UnshardRequest`."""
        request = UnshardRequest(fqn, writeback, rank0_only, offload_to_cpu, recurse, with_grads)
        require_all(self, unshard_capabilities(**request.options()) | self._spec_requirements(model))
        implementation = _implementation(self, "unshard")
        if type(self).PROTOCOL_VERSION >= UNSHARD_REQUEST_VERSION:
            context = implementation(model, request)
        else:  # written for protocol 5 or earlier: the options as keywords (conformance.protocol.versions)
            context = implementation(model, request.fqn, **request.options())
        with context:
            yield

    @abc.abstractmethod
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> AbstractContextManager[None]:
        """Context in which the submodule at ``request.fqn`` ("" = root) exposes full parameters.

        Inside, ``named_parameters()`` of the module :meth:`shard` returned shows full
        tensors under the original FQNs once the declared :attr:`WRAPPER_COMPONENTS` are
        removed (also with flat parameters: the originals, not the flat parameter). The
        request's options (:class:`UnshardRequest`): ``writeback``, changes made inside persist
        after exit; ``rank0_only``, only rank 0 materialises full parameters;
        ``offload_to_cpu``, the full parameters live on CPU; ``recurse=False``, only the unit at
        ``fqn`` is unsharded, not units nested in it; ``with_grads``, gradients are unsharded
        too. Invalid combinations raise the backend's own error, declared in :attr:`REFUSALS`
        (scenarios check it exactly).
        """

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        """Model state dict keyed by original FQNs (see :class:`StateDictKind`)."""
        require_all(self, {Capability.for_state_dict(kind)} | self._spec_requirements(model))
        return _implementation(self, "state_dict")(model, kind)

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        """Load a state dict of ``kind`` produced by :meth:`state_dict` (strict)."""
        require_all(self, {Capability.for_state_dict(kind)} | self._spec_requirements(model))
        _implementation(self, "load_state_dict")(model, state_dict, kind)

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        """Optimizer state dict keyed by parameter FQNs."""
        needed = {Capability.OPTIM_STATE_DICT, Capability.for_state_dict(kind)}
        require_all(self, needed | self._spec_requirements(model))
        return _implementation(self, "optim_state_dict")(model, optim, kind)

    def load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        """Load an optimizer state dict produced by :meth:`optim_state_dict`."""
        needed = {Capability.OPTIM_STATE_DICT, Capability.for_state_dict(kind)}
        require_all(self, needed | self._spec_requirements(model))
        _implementation(self, "load_optim_state_dict")(model, optim, state_dict, kind)

    @abc.abstractmethod
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        """Model state dict keyed by original FQNs (see :class:`StateDictKind`)."""

    @abc.abstractmethod
    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        """Load a state dict of ``kind`` produced by :meth:`state_dict` (strict)."""

    @abc.abstractmethod
    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        """Optimizer state dict keyed by parameter FQNs."""

    @abc.abstractmethod
    def _load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        """Load an optimizer state dict produced by :meth:`optim_state_dict`."""

    # -- native checkpoint (optional capability) -------------------------------------------
    def save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        """Save model and optimizer state in the backend's own sharded format under
        ``directory`` (the same path on every rank; every rank calls this). The suite never
        reads the files: it checks them by round trip (load, compare full state, train on)."""
        require_all(self, {Capability.NATIVE_CHECKPOINT} | self._spec_requirements(model))
        _implementation(self, "save_checkpoint")(model, optim, directory)

    def load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        """Load what :meth:`save_checkpoint` wrote into ``model`` and ``optim`` (sharded alike)."""
        require_all(self, {Capability.NATIVE_CHECKPOINT} | self._spec_requirements(model))
        _implementation(self, "load_checkpoint")(model, optim, directory)

    def _save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        raise AssertionError(f"{type(self).__name__} declares NATIVE_CHECKPOINT but lacks _save_checkpoint")

    def _load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        raise AssertionError(f"{type(self).__name__} declares NATIVE_CHECKPOINT but lacks _load_checkpoint")

    # -- introspection (optional capabilities) ------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        """Whether the unit rooted at FQN ``unit`` currently holds unsharded parameter storage."""
        require(self, Capability.INTROSPECT_UNSHARDED)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_UNSHARDED but lacks it")

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        """Elements of storage this rank holds allocated right now for the unsharded parameters
        of the unit at FQN ``unit`` (every copy counted: a compute-dtype buffer and a
        full-precision one both allocated count twice): 0 once freed; while unsharded, the
        padded size the declared ``SHARD_LAYOUT`` gives (:func:`expected_unsharded_numel`).
        Reads only (no collective). Only for sharded units (a NO_SHARD unit is never freed)."""
        require(self, Capability.INTROSPECT_STORAGE)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_STORAGE but lacks unsharded_storage_numel")

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        """Unit FQN -> FQNs (from the model root) of the parameters that unit manages."""
        require(self, Capability.INTROSPECT_UNIT_FQNS)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_UNIT_FQNS but lacks it")

    def record_events(self, model: nn.Module) -> AbstractContextManager[list[ShardEvent]]:
        """Context yielding a list that fills with every unshard/reshard state change."""
        require(self, Capability.INTROSPECT_EVENTS)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_EVENTS but lacks it")


# Before protocol 3 an adapter implemented the public methods itself; the protocol keeps its
# methods under these names (never an adapter's: protocol 1 and 2 had no private names to
# collide with), so an adapter's own helper called e.g. ``_unshard`` stays the adapter's.
_ADOPTED_PREFIX = "_protocol_adopted_"
# The first protocol version in which adapters implement the underscored methods and declare
# their wrapper's path components (WRAPPER_COMPONENTS); older adapters are adopted.
_TEMPLATE_METHODS_VERSION = 3


def _adopted_name(public: str) -> str:
    return f"{_ADOPTED_PREFIX}{public}"


def _is_old(cls: type) -> bool:
    return getattr(cls, "PROTOCOL_VERSION", 1) < _TEMPLATE_METHODS_VERSION


def _implementation(adapter: BackendAdapter, public: str) -> Any:
    """The bound method a template method calls for ``public``: that of the nearest class (in the
    MRO) that provides it, by an adopted public method (an old adapter's) or by the underscored
    implementation (a current adapter's, or the protocol's own default). An old adapter's
    underscored names are its own helpers, never the implementation."""
    adopted, implementation = _adopted_name(public), TEMPLATE_METHODS[public]
    if not _is_old(type(adapter)):
        # A current adapter: plain attribute lookup, so a helper base class without a version of
        # its own (the torch adapters' common base) and an instance attribute both count.
        return getattr(adapter, implementation)
    for klass in type(adapter).__mro__:
        members = vars(klass)
        if adopted in members:
            return members[adopted].__get__(adapter, type(adapter))
        declares_current = members.get("PROTOCOL_VERSION", 0) >= _TEMPLATE_METHODS_VERSION
        if implementation in members and (klass is BackendAdapter or declares_current):
            return members[implementation].__get__(adapter, type(adapter))
    raise AssertionError(f"BackendAdapter defines {implementation}: unreachable")


def _adopt_implementations(cls: type[BackendAdapter]) -> None:
    """Keep the public methods the protocol's templates.

    An adapter written for a protocol before version 3 implemented ``shard``, ``unshard`` and the
    state-dict methods itself: its methods become the implementations behind the checking
    templates, so it keeps running and gains the checks. They are kept under a name of the
    protocol's (``_protocol_adopted_unshard``), never under ``_unshard``: an old adapter may have
    its own helper by that name (``_unshard(engine, fqn, writeback)``), which must stay the one
    its own code calls and must never be taken for the implementation. Where the adapter has no
    ``_unshard`` of its own, the adopted method also fills that abstract slot. From version 3 on,
    an adapter implements the underscored methods; overriding a public one is refused, since it
    would bypass the capability checks.
    """
    for public, implementation in TEMPLATE_METHODS.items():
        if public not in vars(cls):
            continue
        if not _is_old(cls):
            raise TypeError(
                f"{cls.__name__} overrides {public}(), which checks the declared capabilities before "
                f"calling the adapter: implement {implementation}() instead (protocol version "
                f"{cls.PROTOCOL_VERSION}; docs/writing-an-adapter.md)"
            )
        adopted = vars(cls)[public]
        setattr(cls, _adopted_name(public), adopted)
        if getattr(getattr(cls, implementation, None), "__isabstractmethod__", False):
            setattr(cls, implementation, adopted)
        delattr(cls, public)


def _adopt_name_lookup(cls: type[BackendAdapter]) -> None:
    """Give an adapter written before protocol 3 a parameter lookup that sees through its wrapper.

    Such an adapter could not declare ``WRAPPER_COMPONENTS``: the storage hooks' default lookup
    (``named_parameter``, through ``original_fqn``) then misses a parameter its wrapper shows as
    ``module.<fqn>`` (a ZeRO engine, DDP). Where the adapter keeps the default lookup, a name
    that matches no parameter exactly matches the one parameter whose name ends in ``.<fqn>``
    (the wrapper's leading path); none or several is an error naming the fix.
    """
    if _is_old(cls) and cls.named_parameter is BackendHooks.named_parameter:
        cls.named_parameter = _named_parameter_through_wrapper  # type: ignore[method-assign]


def _named_parameter_through_wrapper(self: BackendAdapter, model: nn.Module, fqn: str) -> nn.Parameter:
    """:meth:`BackendHooks.named_parameter` for an adapter written before protocol 3 (see
    :func:`_adopt_name_lookup`)."""
    try:
        return BackendHooks.named_parameter(self, model, fqn)
    except KeyError as missing:
        problem = missing.args[0]
    suffix = f".{fqn}"
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if self.original_fqn(name).endswith(suffix):
            found.setdefault(id(param), (name, param))
    if len(found) == 1:
        return next(iter(found.values()))[1]
    shown = sorted(name for name, _ in found.values())
    raise KeyError(
        f"{problem}; {type(self).__name__} was written for protocol version {self.PROTOCOL_VERSION}, before "
        f"adapters declared the path components their wrapper inserts, and "
        + (f"several parameters end in {suffix!r}: {shown}" if shown else f"no parameter ends in {suffix!r}")
        + ". Declare them in WRAPPER_COMPONENTS (e.g. frozenset({'module'})) and set PROTOCOL_VERSION "
        "(docs/writing-an-adapter.md)"
    )
