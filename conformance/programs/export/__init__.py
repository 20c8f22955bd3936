"""``--export-repro DIR``: a failing generated program as a standalone torchrun script.

A finding is only useful upstream if the maintainers can run it without this suite. For the
torch backends (FSDP1, FSDP2, DDP / ZeroRedundancyOptimizer) :func:`export_repro` writes the
program as one script that imports only torch and the standard library: the generated model, the
per-rank batches and the single-process oracle written out inline (the same values as
``conformance.programs.model``, ``fixtures.data`` and ``conformance.programs.shadow``), the
sharding done with the native calls the suite's adapter makes for the program's setup, every
operation as native calls, and after each operation the checks ``conformance.programs.run``
makes, with the bounds of ``conformance.programs.tolerances``. It prints each mismatch as
``rank R, op I (<operation>): <what differs>`` and exits 1, or prints ``OK: ...`` and exits 0; an
operation that raises prints ``rank R, op I (<operation>): raised <Type>: <message>`` and the
error propagates (a non-zero exit, with its traceback), as a backend error ends the program there.
2-D programs (``Setup.tensor_parallel``) are written for FSDP1 and FSDP2: the (dp, tp) mesh, the
tensor-parallel plan applied before sharding over its dp dimension, and each dp group's ranks
feeding that group's batch, as ``run`` does it.

The script is assembled from one small template per concern, and each template emits only what the
program uses, so the script reads like something a user wrote for the bug report. The templates
live by concern: ``preamble`` (header, imports, constants), ``oracle`` (model, data, oracle,
checks), ``sharding``, ``run_class`` and ``operations`` (the ``Run`` class's methods, each
operation's lines, ``main``); ``uses`` says what a program uses of them and ``assemble`` puts
the script together. Two checks of the
suite are not exported, as they read backend internals no upstream report should depend on:
the storage claim (what each rank holds of each tensor) and the cross-rank collective trace.
"""

from conformance.programs.export.assemble import export_repro, repro_script
from conformance.programs.export.uses import EXPORTABLE_BACKENDS, ORDER_WARNING, script_name

__all__ = ["EXPORTABLE_BACKENDS", "ORDER_WARNING", "export_repro", "repro_script", "script_name"]
