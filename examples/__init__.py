"""Example tasks that train on data present on every machine; `python -m trainer` runs `CharGPT`."""

from examples.char_gpt import CharGPT

__all__ = ["CharGPT"]
