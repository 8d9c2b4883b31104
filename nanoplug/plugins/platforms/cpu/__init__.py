"""Platform `cpu`: float32 steps through nanoplug's C++ kernels and packed weights (`platform.py`)."""
