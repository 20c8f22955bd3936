"""torch's Flight Recorder dumps as the harness's collective records (`harness.trace.records`).

Flight Recorder (`TORCH_FR_BUFFER_SIZE=<entries>`, NCCL and gloo) keeps each rank's last collectives
and writes them on a watchdog timeout (`TORCH_FR_DUMP_TEMP_FILE`, default `/tmp/nccl_trace_rank_<r>`)
or when asked (`torch._C._distributed_c10d._dump_fr_trace()`), pickled or as JSON. Each entry
becomes a `CollectiveRecord`: op (from `profiling_name`), group (the process group's ranks, and
torch's name for it where the dump has the group's configuration), its sequence number on that
group, input shapes and dtypes, the call site (the innermost stack frame outside torch and the
harness) and whether it completed, so the differ (`harness.trace.divergence`) reads them as it
reads a test's traces. Tensor names, labels, the arguments that must agree and what exchanging
collectives send each member are not in the dumps, so they are not compared. Point-to-point
entries are listed but not matched (the dumps do not say the peer).

Read by `python -m harness.tools.flight_recorder` and by the pool session, which turns the dumps a
CUDA pool's watchdog wrote into the failed test's report (`harness.session.pool_session`).
The rank of a dump is the number its file name ends in (torch names them so).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

from harness.trace.divergence import diagnosis, format_trace_table
from harness.trace.records import CollectiveRecord

__all__ = ["dump_files", "dump_report", "read_dump", "read_dumps"]

_RANK_SUFFIX = re.compile(r"(\d+)(\.json)?$")
_TORCH_DIR = f"{os.sep}torch{os.sep}"
_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the harness package
# Flight Recorder's dtype spellings (c10::ScalarType names) -> the trace's (torch.<name>).
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64"}
_DTYPES.update({"Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"})


def read_dump(path: str | Path) -> tuple[int, list[CollectiveRecord]]:
    """One rank's dump: its rank (from the file name) and its entries as records."""
    path = Path(path)
    found = _RANK_SUFFIX.search(path.name)
    if found is None:
        raise ValueError(f"{path}: cannot tell its rank; Flight Recorder dump names end in the rank number")
    rank = int(found.group(1))
    raw = path.read_bytes()
    try:
        # Pickled dumps execute code when loaded, as with torch's own analyzer: read only your own.
        dump = json.loads(raw) if raw.lstrip().startswith(b"{") else pickle.loads(raw)
    except (pickle.UnpicklingError, json.JSONDecodeError, EOFError) as error:
        raise ValueError(f"{path}: not a Flight Recorder dump ({error})") from None
    if not isinstance(dump, dict) or "entries" not in dump:
        raise ValueError(f"{path}: not a Flight Recorder dump (no 'entries')")
    groups: dict[str, tuple[int, ...]] = {}
    for name, config in dump.get("pg_config", {}).items():
        for key in (name, config.get("name"), config.get("desc")):
            if key:
                groups.setdefault(str(key), _ranks(config))
    if len(dump.get("pg_config", {})) == 1:  # some torch versions key the only group by "": it is the default one
        groups.setdefault("", _ranks(next(iter(dump["pg_config"].values()))))
    records: list[CollectiveRecord] = []
    for index, entry in enumerate(dump["entries"]):
        records.append(_record(rank, index, entry, groups))
    return rank, records


def dump_files(paths: list[str | Path]) -> list[Path]:
    """The dump files `paths` name; a directory stands for the files in it whose names end in a rank."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file() and _RANK_SUFFIX.search(p.name)))
        else:
            files.append(path)
    return files


def read_dumps(paths: list[str | Path]) -> dict[int, list[CollectiveRecord]]:
    """Every rank's records; a directory stands for the files in it whose names end in a rank."""
    traces: dict[int, list[CollectiveRecord]] = {}
    for file in dump_files(paths):
        rank, records = read_dump(file)
        traces[rank] = records
    return traces


def _record(rank: int, index: int, entry: dict[str, Any], groups: dict[str, tuple[int, ...]]) -> CollectiveRecord:
    process_group = entry.get("process_group") or ("", "")
    group = groups.get(str(process_group[0])) or groups.get(str(process_group[1])) or groups.get("") or ()
    # The dump names an entry's group as torch does (what the harness's own traces record); where
    # it does not, the members alone tell groups apart.
    group_name = str(process_group[0]) if str(process_group[0]) in groups else ""
    name = str(entry.get("profiling_name", "")).rpartition(":")[2] or "unknown"
    is_p2p = bool(entry.get("is_p2p"))
    seq = int(entry.get("p2p_seq_id" if is_p2p else "collective_seq_id") or 0) - 1
    shapes = tuple(tuple(int(d) for d in shape) for shape in entry.get("input_sizes", []))
    dtypes = tuple(_DTYPES.get(d, str(d).lower()) for d in entry.get("input_dtypes", []))
    numel = sum(_product(shape) for shape in shapes)
    completed = entry.get("state") == "completed" or bool(entry.get("retired"))
    record = CollectiveRecord(
        rank=rank,
        index=index,
        seq=seq,
        op=name.split(" ")[0],
        group=group,
        shapes=shapes,
        dtypes=dtypes,
        numel=numel,
        label="",
        site=_site(entry.get("frames", [])),
        group_name=group_name,
    )
    record.completed = completed
    return record


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch and the harness (Flight Recorder lists innermost first)."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename and not filename.startswith(("<", _HARNESS_DIR)) and _TORCH_DIR not in filename:
            relative = os.path.relpath(filename)
            return f"{filename if relative.startswith('..') else relative}:{frame.get('line', '?')}"
    return ""


def _ranks(config: dict[str, Any]) -> tuple[int, ...]:
    ranks = config.get("ranks", ())
    if isinstance(ranks, str):  # the dump spells them "[0, 1]"
        ranks = ast.literal_eval(ranks) if ranks.strip() else ()
    return tuple(int(r) for r in ranks)


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


LAST_ENTRIES_SHOWN = 8
"""Each rank's last entries a test's report shows (a dump holds up to TORCH_FR_BUFFER_SIZE)."""


def dump_report(paths: list[str], world_ranks: list[int]) -> str:
    """The section a failed test's report gets from the dumps its ranks wrote (NCCL's watchdog
    writes one per rank on a collective timeout): NCCL's own account of the first divergence and of
    the collectives each rank never completed, then each rank's last entries. "" without dumps; a
    dump that cannot be read is named, and the others are still read."""
    if not paths:
        return ""
    traces: dict[int, list[CollectiveRecord]] = {}
    unreadable = []
    for path in paths:
        try:
            rank, records = read_dump(path)
        except (OSError, ValueError) as error:
            unreadable.append(str(error))
            continue
        traces[rank] = records
    lines = [f"Flight Recorder dumps written during the test ({', '.join(paths)}):"]
    if traces:
        missing = [rank for rank in world_ranks if rank not in traces]
        lines.append(diagnosis(traces, sorted(traces)))
        if missing:
            lines.append(f"(no dump from rank{'s' * (len(missing) != 1)} {', '.join(map(str, missing))})")
        last = {rank: records[-LAST_ENTRIES_SHOWN:] for rank, records in traces.items()}
        lines += [f"each rank's last {LAST_ENTRIES_SHOWN} entries:", format_trace_table(last).rstrip()]
    lines += [f"unreadable: {text}" for text in unreadable]
    return "\n".join(lines)
