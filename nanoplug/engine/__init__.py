"""The engine process: requests in, steps out. It knows no plugin by name and finds them through the registry."""
