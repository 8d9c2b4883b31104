"""One device's worker: builds the model, then plans, runs and samples each step the engine hands it.
It never imports the engine: under tensor parallelism it lives in another process."""
