"""Built-in platforms: one package per device family (`cpu`, `cuda`)."""
