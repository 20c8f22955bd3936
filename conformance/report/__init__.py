"""The conformance reports, rendered from what the suite hands them: the matrix
(`matrix`, `conformance.md`) and the self-contained HTML page (`html`, with `timeline_svg` and
`trace_view` for a failed test's collectives).
"""
