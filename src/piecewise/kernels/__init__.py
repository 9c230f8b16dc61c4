"""Custom kernels for inference on Hopper (Triton, each beside a pure-PyTorch reference): ``nvfp4``."""
