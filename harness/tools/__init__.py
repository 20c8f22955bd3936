"""Command-line tools (`python -m harness.tools.<tool>`): trace a plain script, read Flight Recorder dumps."""
