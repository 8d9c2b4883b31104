"""Built-in parallel plugins."""
