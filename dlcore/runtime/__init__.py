"""Running implementations: the warm launch path for compiled Triton kernels and the PyTorch
integration (custom ops, fake kernels, autograd) of kernel modules."""
