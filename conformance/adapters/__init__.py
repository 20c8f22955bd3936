"""Adapters shipped with the suite; third-party ones plug in through conformance.suite.registry."""
