"""Whether the members' calls of one exchanging collective pair up: what each sends, the other expects.

In all_to_all and all_to_all_single, scatter, gather, and all_gather and reduce_scatter with lists,
each member sends a piece of its own to each other member, and the sizes may differ from pair to
pair (an MoE token exchange). What the collective requires is not that the ranks pass equal lists
but that they pair up: rank i's piece for rank j has as many elements as rank j expects from rank i,
and each rank gives a size for every member. A rank with a stale split (last step's capacity) breaks
that; gloo aborts a rank or hangs, NCCL may exchange garbage. The records carry each rank's sizes
(`CollectiveRecord.sends` / `receives`, elements per member in the group's order); this module finds
the first pair that does not add up and says it with each rank's sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.trace.records import CollectiveRecord

__all__ = ["ExchangeMismatch", "exchange_mismatch"]


@dataclass(frozen=True)
class ExchangeMismatch:
    """The first pair of members whose sizes disagree, and every member's sizes."""

    op: str
    problem: str
    """ "rank 0 sends 4 to rank 1 but rank 1 expects 3 from rank 0", or a list of the wrong length."""
    more: int
    """How many other pairs (or lists) disagree as well."""
    sizes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]
    """Per rank, (sends, receives) as recorded."""

    def describe(self) -> str:
        text = f"{self.op}: {self.problem}"
        if self.more:
            text += f" (and {self.more} more that do not add up)"
        per_rank = "; ".join(
            f"rank {rank} sends {_sizes(sends)}, expects {_sizes(receives)}"
            for rank, (sends, receives) in sorted(self.sizes.items())
        )
        return f"{text}; elements per member: {per_rank}"


def exchange_mismatch(calls: dict[int, CollectiveRecord]) -> ExchangeMismatch | None:
    """Why the members' calls of one collective (rank -> its record, every member present) cannot
    pair up, or None when they do or carry no sizes (other ops, traces without them)."""
    if not calls or any(record.sends is None or record.receives is None for record in calls.values()):
        return None
    first = next(iter(calls.values()))
    group = first.group
    if set(calls) != set(group) or any(record.group != group for record in calls.values()):
        return None
    size = len(group)
    lengths: list[str] = []
    for rank, record in calls.items():
        for kind, values in (("sends to", record.sends), ("expects from", record.receives)):
            if len(values) != size:  # type: ignore[arg-type]
                lengths.append(f"rank {rank} gives the sizes it {kind} {len(values)} members in a group of {size}")  # type: ignore[arg-type]
    if lengths:
        return ExchangeMismatch(first.op, lengths[0], len(lengths) - 1, _sizes_of(calls))
    position = {rank: index for index, rank in enumerate(group)}
    across: list[str] = []
    within: list[str] = []
    for source in group:
        for target in group:
            sent = calls[source].sends[position[target]]  # type: ignore[index]
            expected = calls[target].receives[position[source]]  # type: ignore[index]
            if sent == expected:
                continue
            if source == target:
                within.append(f"rank {source} sends {sent} to itself but expects {expected}")
            else:
                expects = f"rank {target} expects {expected} from rank {source}"
                across.append(f"rank {source} sends {sent} to rank {target} but {expects}")
    problems = across + within
    if not problems:
        return None
    return ExchangeMismatch(first.op, problems[0], len(problems) - 1, _sizes_of(calls))


def _sizes_of(calls: dict[int, CollectiveRecord]) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {rank: (record.sends or (), record.receives or ()) for rank, record in calls.items()}


def _sizes(values: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, values)) + "]"
