"""Small C kernels built on first use with the machine's C compiler (torch-free)."""
