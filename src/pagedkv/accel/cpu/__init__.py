"""The CPU backend: oneDNN's packed weights, and small C kernels built on first use (fused
norms, the fused SwiGLU activation, packed products of few rows, the decode layers program)."""
