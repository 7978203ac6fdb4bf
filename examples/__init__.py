"""Example tasks that train on data present on every machine; `python -m syncline` runs `CharGPT`."""

from syncline.examples.char_gpt import CharGPT

__all__ = ["CharGPT"]
