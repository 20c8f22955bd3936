"""Text the harness shows, written one way wherever it appears.

Bounding text that is kept or sent: a cut keeps the end (what explains a failure) and says
exactly how much it dropped, in the unit it cut (bytes of a file, characters of a string).
Captured output is cut once, where it is read (`read_tail`, bytes); report writers cut longer
texts again with `clip` (characters), each notice exact for what that cut removed.

Naming things in messages: ranks (`ranks_text`: "rank 0", "ranks 0, 1"), a process group's
members (`group_text`: "[0, 1]") and a path (`shown_path`: relative to the working directory
when it is under it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence


def bytes_cut_notice(dropped: int) -> str:
    return f"[... {dropped} bytes cut ...]\n"


def chars_cut_notice(dropped: int) -> str:
    return f"[... {dropped} characters cut ...]\n"


def read_tail(path: str, limit_bytes: int) -> str:
    """The last `limit_bytes` bytes of a file, decoded (invalid UTF-8 replaced), after a notice
    counting the bytes before them; "" for a missing file."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - limit_bytes)
            handle.seek(start)
            data = handle.read(size - start)
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    return bytes_cut_notice(start) + text if start else text


def clip(text: str, limit_chars: int) -> str:
    """`text` if it has at most `limit_chars` characters, else its end after a notice counting the
    characters dropped."""
    if len(text) <= limit_chars:
        return text
    return chars_cut_notice(len(text) - limit_chars) + text[-limit_chars:]


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def describe_exception(error: BaseException) -> str:
    """`Type: first line of the message`, even for an exception whose `__str__` raises or returns
    something that is not a string (a test's exception must never break its own report)."""
    name = type(error).__name__
    try:
        message = str(error)
    except Exception as failure:  # noqa: BLE001 - any failure of a foreign __str__ is reported the same way
        message = f"<str() of the exception raised {type(failure).__name__}>"
    line = first_line(message)
    return f"{name}: {line}" if line else name


def ranks_text(ranks: Sequence[int]) -> str:
    """ "rank 0" for one rank, "ranks 0, 2" for several, in the order given."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def group_text(ranks: Iterable[int]) -> str:
    """The members of a process group (global ranks) as a list: "[0, 1]"."""
    return "[" + ", ".join(map(str, ranks)) + "]"


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies under it, else as given."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
