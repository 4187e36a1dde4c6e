"""Triton kernels; each has a PyTorch reference in `stream_rlhf.kernels` and a test comparing the two."""
