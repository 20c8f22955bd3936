"""How reports name the process group of a collective: by its members, and by its identity where
the members alone would not tell it apart.

A trace stream is one process group (`CollectiveRecord.group_key`), not a set of ranks: two groups
with the same members created one after the other are two streams, and a rank that takes them in
the other order than its peer deadlocks. Naming every group by identity would clutter the common
case (one group per member set), so text names a group by its members ("[0, 1]") and adds its
identity only where the traces at hand hold several groups with those members ("#2 [0, 1]"):
  * "#k": the k-th group created during the test (`CollectiveRecord.group_number`);
  * "WORLD": the default group;
  * '"name"': a group created before the test began, by torch's name for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.message_text import group_text
from harness.trace.records import CollectiveRecord

__all__ = ["GroupNames", "group_identity"]


def group_identity(record: CollectiveRecord) -> str:
    """The identity of a record's group as reports write it ("#2", "WORLD", '"5"'), "" if unknown."""
    if record.group_number is not None:
        return "WORLD" if record.group_number == 0 else f"#{record.group_number}"
    return f'"{record.group_name}"' if record.group_name else ""


class GroupNames:
    """Names the groups of a set of traces: members alone, or identity and members where the
    traces hold several groups with the same members."""

    def __init__(self, records: Iterable[CollectiveRecord]) -> None:
        keys_by_members: dict[tuple[int, ...], set[str]] = {}
        for record in records:
            if not record.is_p2p:
                keys_by_members.setdefault(record.group, set()).add(record.group_name)
        self._ambiguous = {members for members, names in keys_by_members.items() if len(names) > 1}

    @classmethod
    def of(cls, traces: dict[int, list[CollectiveRecord]]) -> GroupNames:
        return cls(record for records in traces.values() for record in records)

    def name(self, record: CollectiveRecord) -> str:
        """ "[0, 1]", or "#2 [0, 1]" where another group of the traces has the same members."""
        members = group_text(record.group)
        identity = group_identity(record) if record.group in self._ambiguous else ""
        return f"{identity} {members}" if identity else members

    def non_member_call(self, record: CollectiveRecord) -> str:
        """A call on a group the rank is not a member of: "all_reduce on group [0, 1] (t.py:20),
        which it is not a member of"."""
        group = f"group {self.name(record)}" if record.group else "a group"
        where = f" ({record.site})" if record.site else ""
        return f"{record.op} on {group}{where}, which it is not a member of"
