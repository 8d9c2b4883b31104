"""The kernel library plugins share: C++ and Triton kernels and their torch wrappers.
A leaf: it imports nothing of nanoplug but the SDK (`nanoplug.api`)."""
