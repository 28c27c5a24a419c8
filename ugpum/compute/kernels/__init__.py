"""Triton kernels for what PyTorch's own ops do in more passes or on older tensor-core paths, each a custom op
with a PyTorch form for the CPU and for installs without Triton (tests run both forms: the kernels in Triton's
interpreter)."""
