"""Conformance suite: the backend adapter protocol, backend selection and the scenarios."""
