"""syncline's benchmark suite: the DDP paper's experiments on this machine. Run `python -m benchmarks`."""
