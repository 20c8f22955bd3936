"""Where each rank's side files live inside a pool's private run directory."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFiles:
    run_dir: str
    rank: int

    def _path(self, suffix: str) -> str:
        return os.path.join(self.run_dir, f"rank-{self.rank}.{suffix}")

    @property
    def stdout(self) -> str:
        return self._path("out")

    @property
    def stderr(self) -> str:
        return self._path("err")

    @property
    def stacks(self) -> str:
        return self._path("stacks")

    @property
    def trace(self) -> str:
        return self._path("trace")

    @property
    def raised(self) -> str:
        """The test's exception, written by the rank as soon as the body raised (before teardown),
        so it is known even if the rank dies afterwards; emptied by the parent before each test."""
        return self._path("raised")
