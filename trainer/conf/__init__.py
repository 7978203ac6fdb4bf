"""Packaged Hydra configs of `python -m trainer`: config.yaml and the task/ and callbacks/ groups."""
