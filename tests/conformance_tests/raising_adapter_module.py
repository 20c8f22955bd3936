"""An adapter module that fails at import with something other than ImportError (test_versions.py)."""

raise RuntimeError("CUDA driver initialization failed")
