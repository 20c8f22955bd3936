"""Command-line tools that use the trace diff without a pytest session.

torchrun --nproc-per-node 2 -m harness.tools.trace_script train.py   # trace and diff a script
python -m harness.tools.flight_recorder DUMPS                         # torch Flight Recorder dumps
"""
