"""Packaged Hydra configs of `python -m syncline`: config.yaml and the task/ and callbacks/ groups."""
