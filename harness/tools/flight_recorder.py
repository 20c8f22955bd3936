"""Read torch's Flight Recorder dumps into the harness's differ (`harness.trace.divergence`).

    python -m harness.tools.flight_recorder /tmp/nccl_trace_rank_0 /tmp/nccl_trace_rank_1 ...
    python -m harness.tools.flight_recorder DUMP_DIR            # every file in it ending in a rank number

Prints the first divergence and the collectives each rank was stuck in, as for a test, then every
rank's entries side by side. What a dump holds and how it becomes records:
`harness.trace.flight_recorder`. Pickled dumps execute code when loaded, as with torch's own
analyzer: read only your own.
"""

from __future__ import annotations

import sys

from harness.trace.divergence import diagnosis, format_trace_table
from harness.trace.flight_recorder import read_dump, read_dumps

__all__ = ["main", "read_dump", "read_dumps"]


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths or paths[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if paths else 2
    try:
        traces = read_dumps(paths)
    except (OSError, ValueError) as error:
        print(f"harness.tools.flight_recorder: {error}", file=sys.stderr)
        return 2
    print(diagnosis(traces, sorted(traces)))
    print()
    print(format_trace_table(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
