"""The conformance reports: the matrix (markdown) and the HTML page."""
