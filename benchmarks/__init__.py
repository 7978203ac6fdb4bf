"""syncline's benchmark suite: the DDP paper's experiments on this machine. Run `python -m benchmarks`."""

#: The module that starts a benchmark command in a fresh interpreter (a training run, a lab node's worker).
#: Installed, the suite is `syncline.benchmarks`, importable from any folder (the top-level `benchmarks` only
#: from a checkout's root), so a lab job can run in the user's own folder.
MODULE = "syncline.benchmarks"
