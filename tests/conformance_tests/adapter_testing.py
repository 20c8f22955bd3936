"""Helpers for the adapters' self-tests: the protocol's training loop, and small pytest
sessions in a subprocess (with the repository's configuration and the given backends) for
what the rank fixture and the plugins do end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.protocol import BackendAdapter
from tests.support.warm_pytest import run_pytest

REPO = Path(__file__).resolve().parents[2]


def train_steps(
    backend: BackendAdapter,
    sharded: nn.Module,
    loss_model: nn.Module,
    optim: object,
    iterations: int,
    rank: int,
    device: torch.device,
    *,
    seed: int = 0,
    first_iteration: int = 0,
    batch_size: int = 2,
) -> list[float]:
    """The scenario training loop of the protocol's training-loop contract; the local losses."""
    losses = []
    for iteration in range(first_iteration, first_iteration + iterations):
        inputs = fixtures.local_batch(
            loss_model, seed=seed, iteration=iteration, rank=rank, batch_size=batch_size, device=device
        )
        backend.zero_grad(sharded, optim)
        loss = loss_model.loss(sharded(*inputs))
        backend.backward(sharded, loss)
        backend.step(sharded, optim)
        losses.append(loss.item())
    return losses


def run_inner_session(
    directory: Path,
    tests: str,
    backends: list[str],
    *extra: str,
    timeout_s: float = 300,
    unset_env: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Write ``tests`` to ``directory/test_inner.py`` and run it once per backend selection,
    without the environment variables named in ``unset_env``."""
    (directory / "test_inner.py").write_text(tests)
    (directory / "expectations").mkdir(exist_ok=True)  # none: see the raw outcomes
    command = [
        sys.executable,
        "-m",
        "pytest",
        "test_inner.py",
        "-c",
        str(REPO / "pyproject.toml"),
        "--rootdir",
        str(directory),
        "-p",
        "harness.plugin",
        "-p",
        "conformance.suite.backend_plugin",
        "-p",
        "no:cacheprovider",
        "--reports-dir",
        str(directory / "reports"),
        "--expectations-dir",
        str(directory / "expectations"),
        "-rA",
        "-q",
        *extra,
        *[arg for backend in backends for arg in ("--backend", backend)],
    ]
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {key: value for key, value in os.environ.items() if key not in unset_env}
    try:
        return run_pytest(command, cwd=directory, env={**env, "PYTHONPATH": python_path}, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the inner session hung for {timeout_s}s:\n{expired.stdout}")


# "#  group/peer  group #  op  label ..." rows of harness.trace.divergence.format_trace_table.
_TRACE_ROW = re.compile(r"^\s*\d+\s+\[[\d, ]*\]\s+\d+\s+(?P<op>\S+)\s+(?P<rest>.*)$")


def traced_tables(output: str) -> list[str]:
    """The --show-traces tables of an inner session, in the order its tests ran."""
    return output.split("--- collective traces ---")[1:]


def ops_labelled(table: str, fragment: str) -> set[str]:
    """The ops in one trace table whose label mentions ``fragment``."""
    rows = (_TRACE_ROW.match(line) for line in table.splitlines())
    return {row["op"] for row in rows if row and fragment in row["rest"]}
