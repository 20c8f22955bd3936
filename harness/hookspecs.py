"""Hooks other plugins implement to extend the harness (registered by harness.plugin)."""
from __future__ import annotations

import pytest


def pytest_harness_repro_args(item: pytest.Item) -> list[str]:
    """Extra command-line arguments the reproduction line of a failed distributed test needs.

    E.g. the conformance plugin returns ["--backend", "torch-fsdp2"]. Every implementation's
    list is appended.
    """
    raise NotImplementedError  # a hook specification: pytest collects the implementations
