"""Compiled and JIT kernels that stream_rlhf loads on demand; none is imported on the CPU path."""
