"""syncline's network lab: run training jobs on a simulated cluster and see where a step's time goes.

Installed as `syncline.lab` (its sources are `benchmarks/lab/` of the repository); run it from any folder:

    python -m syncline.lab cluster --nodes 4 --rate 100mbit -- -m syncline trainer.max_steps=50
    python -m syncline.lab cluster --nodes 2 --rate 100mbit --strategies all -- -m syncline
    python -m syncline.lab strategies --nodes 2 --rates 100mbit --only bucketed_ddp bytegrad
    python -m syncline.lab tradeoff --nodes 2 --rates 100mbit --only bucketed_ddp "diloco H=100"

- `cluster` (`cluster.py`): a user's own torchrun command on N network namespaces whose links are shaped to a
  rate, with each node's bytes and, for a syncline job, seconds and bytes per step against the link's bound;
- `strategies` (`strategies.py`): every strategy's seconds per step and bytes per node on the default example,
  against the link bound and the algorithmic bound of its wire phases (`bound.py`);
- `tradeoff` (`tradeoff.py`): every strategy's training seconds to a fixed validation loss of the default
  example, per node count and link rate;
- `faults` (`faults.py`): how long a job takes to end after a node is killed, cut off or stuck;
- `live-recovery` (`live_recovery.py`): seconds one failure costs with `recovery="live"` (one launcher per node)
  against a restart from `last.ckpt` and torchft's fault-tolerant DDP (`ft_ddp.py`), a node lost and started again,
  node 0 (the store's host) lost; ``--plot`` draws seconds lost per mode from a run's JSON.

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; where the machine does not permit private network
namespaces each command says why in one line. Results print to the terminal; ``--out FILE`` (``--json`` for
`cluster`) also writes them as JSON.
"""

#: The module a lab job starts in a fresh interpreter (the lab inside its namespaces, a node's worker): installed,
#: it is importable from any folder, so a lab job runs in the user's own.
MODULE = "syncline.lab"
