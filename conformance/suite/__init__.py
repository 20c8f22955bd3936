"""The suite's machinery: which backends run, how their outcomes are judged, what is refused.

`backend_plugin` is the suite's pytest plugin (`--backend`, parametrization, expected failures,
the reports); `registry` maps names to adapter classes; `expectations` reads a backend's known
failures; `gate` refuses at session start a backend that cannot run on a device kind the
session's worlds may get; `vacuity` fails a test that sharded nothing; `backend_fixture` is the
rank-side `backend` fixture.
"""
