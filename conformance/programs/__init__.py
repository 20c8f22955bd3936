"""Generated programs: what ``conformance/test_generated.py`` draws, runs and judges.

The map, in the order a program travels:

- ``program``: a program as plain data (a model shape, a sharding setup, operations), readable
  (``Program.lines``) and with what it requires of a backend;
- ``declared``: a backend's declarations as plain data (asked of rank 0 once per test);
- ``draw``: the hypothesis strategies, drawing only what the backend admits;
- ``operations``: one handler per kind of operation, found by its type: what may be drawn, its
  rank step and checks, its oracle step, what patterns read of it, its lines in a script (a new
  kind is its dataclass in ``program`` and a module there; a checklist test names what is missing);
- ``seeds``: the program of each scenario family every run starts with;
- ``model``, ``shadow``: the generated model and the single-process oracle that runs the same
  program;
- ``run``: rank side, one program through the adapter protocol, checked after every operation
  (oracle, storage claim, forward-order warnings); ``storage_probe`` reads what a rank stores;
- ``tolerances``: the per-dtype bounds of those comparisons;
- ``verdict``: parent side, one example's outcome from every rank's report and the trace diff;
  ``patterns``: the program shapes a backend's recorded generated findings name;
- ``codec``: a program as one line of text (the ``REPRO:`` command's ``--generate-replay``);
- ``export``: a failing program of a torch backend as a standalone torchrun script.
"""
