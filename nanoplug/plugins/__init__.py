"""Built-in plugins, one folder per kind, one module per plugin (listed in nanoplug/registry.toml)."""
