"""Constrained-decoding backends (kind `structured_output`): one module per library."""
