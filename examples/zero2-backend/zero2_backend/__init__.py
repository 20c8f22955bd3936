"""zero2_backend: a ZeRO stage 2 library (``lib``) and its conformance adapter (``adapter``).

The example of a backend repository that validates itself with the conformance suite installed
from a wheel: the adapter is registered under the suite's entry-point group (pyproject.toml), its
known failures are in ``expectations.toml`` beside it, and ``tests/`` holds the one-line suite
file and the proofs of every gap the adapter declares.
"""

from zero2_backend.lib import Zero2, engine_of, wrap

__all__ = ["Zero2", "engine_of", "wrap"]
