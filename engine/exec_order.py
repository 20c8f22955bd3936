"""Forward unit order: recorded once (for prefetching) and validated (for safety).

Mismatched unshard orders make ranks all-gather different units; with equal sizes that silently
mixes parameters, with different sizes it aborts or hangs.  In the first training forward every
rank all-gathers the index of the unit it is about to unshard (one int per unit, first iteration
only) *before* the unit's own all-gather, so a mismatch raises on all ranks together.  Later
iterations compare locally with the first one and warn once.

The first training forward's order is also what forward prefetching follows (`next_after`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from engine import collectives

CHECK_LABEL = "forward order check"


class ForwardOrder:
    """Unit indices in the order root forwards unshard them.

    `first` is the first *training* forward's order (None until one has finished); `current` is
    the forward in progress (eval forwards included, so prefetching knows its position there too).
    """

    def __init__(self) -> None:
        self.first: list[int] | None = None
        self.current: list[int] = []
        self.training = False

    def begin_forward(self, training: bool) -> None:
        """Start a root forward; the previous forward becomes the reference if it was the first
        training one."""
        if self.first is None and self.training and self.current:
            self.first = self.current
        self.current = []
        self.training = training

    def record(self, unit_index: int) -> int:
        """Note that `unit_index` unshards now; returns its position in this forward."""
        self.current.append(unit_index)
        return len(self.current) - 1

    def expected_at(self, position: int) -> int | None:
        """The unit the first training forward unsharded at `position` (None past its end)."""
        if self.first is None or position >= len(self.first):
            return None
        return self.first[position]

    def next_after(self, position: int) -> int | None:
        """The unit expected right after `position` (what forward prefetching gathers)."""
        return self.expected_at(position + 1)


class ExecOrderValidator:
    """Checks a root's training forwards against each other and across ranks."""

    def __init__(self, group: dist.ProcessGroup | None, unit_labels: Sequence[str]) -> None:
        self._group = group
        self._labels = list(unit_labels)
        self._active = False
        self._warned = False

    def begin_forward(self, training: bool) -> None:
        self._active = training

    def before_unshard(self, order: ForwardOrder, unit_index: int, position: int, device: torch.device) -> None:
        """Check that `unit_index`, unsharded at `position`, is what every rank (first training
        forward) / the first training forward (later ones) unshards there."""
        if not self._active:
            return
        if order.first is None:
            self._check_across_ranks(unit_index, position, device)
            return
        if self._warned:
            return
        expected = order.expected_at(position)
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

    def _check_across_ranks(self, unit_index: int, position: int, device: torch.device) -> None:
        mine = torch.tensor([unit_index], dtype=torch.int64, device=device)
        with collectives.labelled(CHECK_LABEL):  # rank-independent: ranks may disagree on the unit
            gathered = collectives.all_gather_small(mine, self._group).view(-1).tolist()
        if len(set(gathered)) == 1:
            return
        self._active = False
        per_rank = "; ".join(f"rank {rank} unshards [{self._labels[index]}]" for rank, index in enumerate(gathered))
        raise RuntimeError(
            f"Forward order differs across ranks: at position {position} {per_rank}. "
            "Every rank must run the same sharded modules in the same order; make the forward "
            "control flow rank-independent."
        )
