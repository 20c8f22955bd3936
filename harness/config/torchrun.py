"""The torchrun world this pytest process is a rank of: torchrun's environment, read in one place.

torchrun's agent starts every worker with `TORCHELASTIC_RUN_ID` (how the harness knows it runs
under torchrun: a pool rank never inherits it, see `harness.process.rank_env`) and with RANK,
LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE. Every part of the harness that needs the world (the
world sizes, the device decision, the torchrun session, the JUnit files) asks `torchrun_world()`
and gets these four numbers as one `TorchrunWorld`, with one rule for a missing variable and one
error for a malformed one. The pool writes the same contract for its own ranks through
`TorchrunWorld.environment()`, so the variable names live here only.

A missing LOCAL_WORLD_SIZE (torchrun always sets it; a hand-made launcher may not) means the
whole world runs on this host: LOCAL_WORLD_SIZE = WORLD_SIZE, and on one host a missing
LOCAL_RANK is RANK, as in a warm pool. That reading never gives two ranks of one host the same
GPU (CUDA worlds need a GPU per rank of the host); a world that spans hosts must say so with
LOCAL_WORLD_SIZE and LOCAL_RANK, as torchrun does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent for every worker it starts; never inherited by a pool rank."""


@dataclass(frozen=True)
class TorchrunWorld:
    """This process's place in a torchrun world; a host runs `local_world_size` of its ranks."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def on_one_host(self) -> bool:
        """Every rank of the world runs on this host (gloo then needs only loopback)."""
        return self.local_world_size == self.world_size

    def environment(self) -> dict[str, str]:
        """The variables torchrun gives a worker of this world, as the pool gives its ranks."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun started this process (see `LAUNCHED_BY_TORCHRUN`)."""
    return LAUNCHED_BY_TORCHRUN in (os.environ if environ is None else environ)


def torchrun_world(environ: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """The torchrun world this process is a rank of, None when torchrun did not start it.

    A missing LOCAL_WORLD_SIZE reads as one host, and then a missing LOCAL_RANK as RANK (see the
    module doc); any other missing variable, or a value that is no whole number in range, is a
    usage error naming the variable.
    """
    env = os.environ if environ is None else environ
    if not launched_by_torchrun(env):
        return None
    world_size = _number(env, "WORLD_SIZE", minimum=1)
    rank = _number(env, "RANK", minimum=0, below=world_size)
    local_world_size = _number(env, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    if local_world_size > world_size:
        raise _malformed("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"], f"is more than WORLD_SIZE ({world_size})")
    one_host = local_world_size == world_size
    local_rank = _number(env, "LOCAL_RANK", minimum=0, below=local_world_size, default=rank if one_host else None)
    return TorchrunWorld(rank, local_rank, world_size, local_world_size)


def _number(
    env: Mapping[str, str], name: str, *, minimum: int, below: int | None = None, default: int | None = None
) -> int:
    """The whole number in variable `name`; `default` when it is not set (None: it must be)."""
    text = env.get(name)
    if text is None:
        if default is not None:
            return default
        raise pytest.UsageError(
            f"{LAUNCHED_BY_TORCHRUN} is set, so this pytest runs as a torchrun worker, but {name} is not: "
            f"launch pytest with torchrun (which sets {name}), or unset {LAUNCHED_BY_TORCHRUN} to run warm pools"
        )
    try:
        value = int(text.strip())
    except ValueError:
        raise _malformed(name, text, "is not a whole number") from None
    if value < minimum:
        raise _malformed(name, text, f"is below {minimum}")
    if below is not None and value >= below:
        bound = {"RANK": "WORLD_SIZE", "LOCAL_RANK": "LOCAL_WORLD_SIZE"}.get(name, "its bound")
        raise _malformed(name, text, f"is not below {bound} ({below})")
    return value


def _malformed(name: str, text: str, problem: str) -> pytest.UsageError:
    return pytest.UsageError(
        f"torchrun's {name}={text!r} {problem}; launch pytest with torchrun, which sets RANK, LOCAL_RANK, "
        "WORLD_SIZE and LOCAL_WORLD_SIZE consistently, or fix the variable in the launcher"
    )
