"""The core: hook specs, registry, config and the engine. It imports no plugin by name."""
