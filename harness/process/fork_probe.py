"""Whether a fork of this process could use CUDA: torch's own bad-fork mark, asked of a child.

torch marks every later fork of a process as unable to use CUDA (``torch.cuda._is_in_bad_fork()``
in the child, "Cannot re-initialize CUDA in forked subprocess" at its first CUDA call) as soon as
the process asks the CUDA runtime anything: ``torch.cuda.is_available()`` and ``device_count()``
do, while ``torch.cuda.is_initialized()`` stays False. The mark is an ``atfork`` handler, with no
flag the parent can read, so the one sure answer is a child's: fork, ask, exit. Used by both
zygotes before they fork ranks (pytest's, ``harness.process.zygote_fork``, and the rank-side one,
``harness.rank.zygote``); a fork that would be marked makes them start cold instead.
"""

from __future__ import annotations

import os
import sys

_MARKED = 17  # the child's exit status when torch marked it


def forks_are_marked_bad() -> bool:
    """Whether a child forked now would be in torch's bad fork for CUDA (False where torch has no
    CUDA: a CPU build never marks one)."""
    torch = sys.modules.get("torch")
    if torch is None or not _has_cuda(torch):
        return False
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if in_bad_fork is None:
        return False  # this torch exposes no mark to ask about
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only answers
        try:
            code = _MARKED if in_bad_fork() else 0
        except BaseException:  # noqa: BLE001 - any failure: say marked, the safe answer
            code = _MARKED
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)


def _has_cuda(torch: object) -> bool:
    version = getattr(torch, "version", None)
    return bool(getattr(version, "cuda", None) or getattr(version, "hip", None))
