"""Built-in weight formats: how a checkpoint's linear weights are stored and applied."""
