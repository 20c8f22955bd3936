"""An out-of-tree style ZeRO-2 backend (zero2_lib) and its conformance adapter, written from the docs."""
