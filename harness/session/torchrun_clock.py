"""Failure times that torchrun ranks can compare: each rank's clock offset against rank 0's.

A pool's ranks share one host and so one clock: their failure times (`RankOutcome.failed_at`)
compare as they are. Torchrun ranks may run on hosts whose clocks differ by more than the gap
between two failures, so at session start each rank measures its offset against rank 0 (the
reference clock) and puts its failure times on that clock, with the offset's uncertainty, before
they are exchanged. The verdict then trusts only differences larger than the uncertainty
(`harness.session.verdict.first_failure`); a rank whose offset could not be measured sends no
time, and the first failed rank is told by message.

How: a few ping-pongs on the session's control group. Rank r notes its clock, sends to rank 0,
which reads its own clock once the message arrived and sends that reading back; r notes its
clock again. Rank 0's reading was taken between r's two readings, so the offset is known to
within half the round trip; the round with the shortest trip gives the estimate. Drift during
the session is not followed (NTP-disciplined clocks drift by microseconds per minute).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from harness.messages import RankResult

__all__ = ["ClockOffset", "measure_offset"]

ROUNDS = 5
"""Ping-pongs per rank: the shortest round trip bounds the offset best."""


@dataclass(frozen=True)
class ClockOffset:
    """What to add to this rank's `time.time()` to read rank 0's clock, and how far that may be off;
    `offset_s` None when it could not be measured (`why_unknown` says why)."""

    offset_s: float | None
    uncertainty_s: float = 0.0
    why_unknown: str = ""

    def on_reference_clock(self, result: RankResult) -> RankResult:
        """`result` with its failure time on rank 0's clock (its own clock's reading shifted by the
        offset, with the offset's uncertainty); without a time when the offset is unknown."""
        if result.failed_at is None:
            return result
        if self.offset_s is None:
            return replace(result, failed_at=None)
        return replace(result, failed_at=result.failed_at + self.offset_s, clock_error_s=self.uncertainty_s)


def measure_offset(group: dist.ProcessGroup, rank: int, world_size: int, rounds: int = ROUNDS) -> ClockOffset:
    """This rank's `ClockOffset` against rank 0, measured over `group` (every rank must call it).

    Rank 0 answers every other rank in turn; a failure (a peer that left, a backend without
    point-to-point) leaves the offset unknown rather than failing the session.
    """
    if rank == 0:
        try:
            for peer in range(1, world_size):
                for _ in range(rounds):
                    ping = torch.zeros(1, dtype=torch.float64)
                    dist.recv(ping, src=peer, group=group)
                    dist.send(torch.tensor([time.time()], dtype=torch.float64), dst=peer, group=group)
        except (RuntimeError, ValueError) as error:  # ValueError: a group torch does not know
            return ClockOffset(None, why_unknown=f"rank 0 could not answer the clock exchange ({error})")
        return ClockOffset(0.0)
    best: tuple[float, float] | None = None  # (round trip, offset)
    try:
        for _ in range(rounds):
            reading = torch.zeros(1, dtype=torch.float64)
            sent_at = time.time()
            dist.send(torch.zeros(1, dtype=torch.float64), dst=0, group=group)
            dist.recv(reading, src=0, group=group)
            received_at = time.time()
            trip = received_at - sent_at
            if best is None or trip < best[0]:
                best = (trip, reading.item() - (sent_at + received_at) / 2)
    except (RuntimeError, ValueError) as error:  # ValueError: a group torch does not know
        return ClockOffset(None, why_unknown=f"the clock exchange with rank 0 failed ({error})")
    assert best is not None, "at least one round of the clock exchange"
    trip, offset = best
    return ClockOffset(offset, trip / 2)
