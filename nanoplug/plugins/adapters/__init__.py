"""Built-in adapters plugins."""
