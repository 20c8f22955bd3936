"""Root conftest: load the harness and the conformance plugins when pytest runs from the repo."""

pytest_plugins = ["harness.plugin", "conformance.suite.backend_plugin"]
