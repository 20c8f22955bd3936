"""Forward execution-order validation.

Mismatched unshard orders make ranks all-gather different units; with equal sizes that silently
mixes parameters, with different sizes it aborts or hangs.  In the first training forward every
rank all-gathers the index of the unit it is about to unshard (one int per unit, first iteration
only) *before* the unit's own all-gather, so a mismatch raises on all ranks together.  Later
iterations compare locally with the first one and warn once.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import collectives


CHECK_LABEL = "forward order check"


class ExecOrderValidator:
    """Tracks the unit unshard order of training forwards of one root."""

    def __init__(self, group: Optional[dist.ProcessGroup], unit_labels: Sequence[str]) -> None:
        self._group = group
        self._labels = list(unit_labels)
        self._first: Optional[list[int]] = None
        self._current: list[int] = []
        self._active = False
        self._warned = False

    def begin_forward(self, training: bool) -> None:
        """Start a root forward; the previous training forward becomes the reference if first."""
        if self._first is None and self._current:
            self._first = self._current
        self._current = []
        self._active = training

    def before_unshard(self, unit_index: int, device: torch.device) -> None:
        """Check `unit_index` is the unit every rank (first iteration) / the first iteration unshards."""
        if not self._active:
            return
        position = len(self._current)
        self._current.append(unit_index)
        if self._first is None:
            self._check_across_ranks(unit_index, device)
            return
        if self._warned:
            return
        expected = self._first[position] if position < len(self._first) else None
        if expected != unit_index:
            self._warned = True
            expected_text = self._labels[expected] if expected is not None else "no unit"
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank "
                f"{dist.get_rank()}. Collectives are unchecked and may give incorrect results or "
                f"hang. At position {position} the first iteration unsharded [{expected_text}] but "
                f"this iteration unshards [{self._labels[unit_index]}]; keep the forward "
                "control flow identical across iterations and ranks.",
                UserWarning,
                stacklevel=4,
            )

    def _check_across_ranks(self, unit_index: int, device: torch.device) -> None:
        mine = torch.tensor([unit_index], dtype=torch.int64, device=device)
        with collectives.labelled(CHECK_LABEL):  # rank-independent: ranks may disagree on the unit
            gathered = collectives.all_gather_small(mine, self._group).view(-1).tolist()
        if len(set(gathered)) == 1:
            return
        self._active = False
        per_rank = "; ".join(
            f"rank {rank} unshards [{self._labels[index]}]" for rank, index in enumerate(gathered)
        )
        raise RuntimeError(
            f"Forward order differs across ranks: at position {len(self._current) - 1} {per_rank}. "
            "Every rank must run the same sharded modules in the same order; make the forward "
            "control flow rank-independent."
        )
