"""syncline's benchmark suite: the DDP paper's experiments on this machine. Run `python -m benchmarks`.

The suite is not installed: it runs from the checkout's root (its results are committed under `results/`). What
users run, the network lab, is: its sources are `lab/`, installed as `syncline.lab`.
"""

#: The module that starts a benchmark command in a fresh interpreter (a training run, a paper experiment's worker on
#: a lab node); `common.ROOT` goes on the child's PYTHONPATH, so that it finds the checkout from any folder.
MODULE = "benchmarks"
