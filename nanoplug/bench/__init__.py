"""`nanoplug bench`'s workloads (throughput, latency) and the random checkpoints they and the tests run on."""
