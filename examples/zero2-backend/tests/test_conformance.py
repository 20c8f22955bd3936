"""The conformance suite, every scenario, against this repository's backend (pyproject.toml's
addopts name it; its known failures are zero2_backend/expectations.toml)."""

from conformance.suite.scenarios import *  # noqa: F403
