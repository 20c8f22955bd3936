"""Backend selection: built-in names, 'all', entry points, module:attr, and the errors."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.protocol import BackendAdapter, Capability
from conformance.suite import registry


@pytest.fixture
def optional_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two optional built-ins: one whose library is importable here, one whose library is not."""
    monkeypatch.setattr(
        registry,
        "OPTIONAL_BUILTIN",
        {
            "present-lib": ("json", "conformance.adapters.torch_fsdp2:TorchFSDP2Adapter", "pip install present"),
            "absent-lib": ("no_such_library_for_tests", "no_such_library_for_tests.a:A", "pip install absent-extra"),
        },
    )


@pytest.fixture
def third_party(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pretend an installed distribution registers 'vendor-fsdp' under our entry-point group."""
    point = EntryPoint(
        name="vendor-fsdp",
        value="conformance.adapters.torch_fsdp2:TorchFSDP2Adapter",
        group=registry.ENTRY_POINT_GROUP,
    )

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        return [point] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    return point.name


@pytest.fixture
def adapter_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable module holding an adapter class and a non-adapter attribute."""
    (tmp_path / "my_backend.py").write_text(
        textwrap.dedent("""
        from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter

        class MyAdapter(TorchFSDP1Adapter):
            name = "my-backend"

        NOT_AN_ADAPTER = 42
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_backend"
    sys.modules.pop("my_backend", None)


def test_builtin_names_are_known_and_default_is_reference() -> None:
    assert registry.known_names()[:3] == ["reference", "torch-fsdp1", "torch-fsdp2"]
    assert registry.DEFAULT == "reference"


def test_select_keeps_order_and_drops_duplicates() -> None:
    chosen = registry.select(["torch-fsdp2", "torch-fsdp1", "torch-fsdp2"])
    assert chosen == ["torch-fsdp2", "torch-fsdp1"]


def test_all_expands_to_builtins_and_entry_points(third_party: str, optional_builtins: None) -> None:
    assert registry.select(["all"]) == [
        "reference",
        "torch-fsdp1",
        "torch-fsdp2",
        "torch-zero",
        "present-lib",
        third_party,
    ]


def test_optional_builtin_is_listed_only_where_its_library_is_installed(optional_builtins: None) -> None:
    assert "present-lib" in registry.known_names()
    assert "absent-lib" not in registry.known_names()
    assert registry.load("present-lib") is TorchFSDP2Adapter
    with pytest.raises(registry.BackendSelectionError) as error:
        registry.select(["absent-lib"])
    assert "needs the 'no_such_library_for_tests' package" in str(error.value)
    assert "pip install absent-extra" in str(error.value)


def test_entry_point_backend_loads(third_party: str) -> None:
    assert registry.select([third_party]) == [third_party]
    assert registry.load(third_party) is TorchFSDP2Adapter
    assert registry.name_of(third_party) == third_party


def test_unknown_name_lists_known_ones(third_party: str) -> None:
    with pytest.raises(registry.BackendSelectionError) as error:
        registry.select(["torch-fsdp3"])
    message = str(error.value)
    assert "unknown backend 'torch-fsdp3'" in message
    for name in ("reference", "torch-fsdp1", "torch-fsdp2", third_party, "module:attr"):
        assert name in message


def test_module_attr_selection(adapter_module: str) -> None:
    target = f"{adapter_module}:MyAdapter"
    assert registry.select([target]) == [target]
    assert registry.load(target).__name__ == "MyAdapter"
    assert registry.name_of(target) == "my-backend"


@pytest.mark.parametrize(
    ("attr", "expected"),
    [("Missing", "has no attribute 'Missing'"), ("NOT_AN_ADAPTER", "not a subclass")],
)
def test_module_attr_errors_fail_at_selection(adapter_module: str, attr: str, expected: str) -> None:
    with pytest.raises(registry.BackendSelectionError, match=expected):
        registry.select([f"{adapter_module}:{attr}"])


def test_unimportable_module_names_the_fix() -> None:
    with pytest.raises(registry.BackendSelectionError) as refused:
        registry.select(["no_such_pkg.mod:Adapter"])
    message = str(refused.value)
    assert "module 'no_such_pkg.mod' is not on the module search path" in message, message
    assert "pass --backend-path DIR with the directory that holds 'no_such_pkg'" in message, message
    assert "Searched (sys.path): " in message, message


def test_missing_builtin_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # How 'reference' behaves while its adapter module does not exist: accepted by name
    # (selection stays cheap), and loading says what is missing.
    monkeypatch.setitem(registry.BUILTIN, "reference", "conformance.adapters.absent:ReferenceAdapter")
    assert registry.select(["reference"]) == ["reference"]
    with pytest.raises(registry.BackendSelectionError, match="backend 'reference' is not available"):
        registry.load("reference")


def test_builtin_torch_adapters_load() -> None:
    assert registry.load("torch-fsdp1") is TorchFSDP1Adapter
    assert registry.load("torch-fsdp2") is TorchFSDP2Adapter


def test_adapter_must_declare_a_form() -> None:
    with pytest.raises(TypeError, match="WRAPPER and/or"):
        type(
            "NoForm",
            (BackendAdapter,),
            {"name": "x", "CAPABILITIES": frozenset({Capability.AUTO_WRAP})},
        )


def test_origin_says_where_each_backend_comes_from(
    third_party: str, optional_builtins: None, adapter_module: str
) -> None:
    assert registry.origin("reference") == "built-in conformance.adapters.reference:ReferenceAdapter"
    assert registry.origin("present-lib").startswith(
        "optional built-in conformance.adapters.torch_fsdp2:TorchFSDP2Adapter (json "
    )
    assert registry.origin(third_party) == (
        "entry point of an installed package: conformance.adapters.torch_fsdp2:TorchFSDP2Adapter"
    )
    assert registry.origin(f"{adapter_module}:MyAdapter") == f"import path {adapter_module}:MyAdapter"
    assert registry.missing_optional() == {"absent-lib": "pip install absent-extra"}
