"""Reading a pytest session's terminal output in the self-tests (which of its tests failed, and how)."""

from __future__ import annotations

import re

_SECTION = re.compile(r"\n_{3,} (test_[\w\[\]\-.]+) _{3,}\n")
_SUMMARY = re.compile(r"\n=+ (short test summary info|warnings summary|PASSES) =+\n")


def failure_sections(stdout: str) -> dict[str, str]:
    """Test name -> its failure text, from a pytest run's terminal output.

    Sections end where the next one starts, or at the short test summary: in CI pytest does not
    truncate summary lines, so without that bound the last failure would swallow the summary of
    every other failure.
    """
    body = _SUMMARY.split(stdout, maxsplit=1)[0]
    parts = _SECTION.split(body)
    return dict(zip(parts[1::2], parts[2::2]))
