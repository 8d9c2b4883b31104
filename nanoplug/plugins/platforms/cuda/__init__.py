"""Platform `cuda`: NVIDIA GPUs (`platform.py`), decode under CUDA graphs (`graphs.py`)."""
