"""Speculators (kind `speculator`): proposers of draft tokens, one module each."""
