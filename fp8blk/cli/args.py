"""argparse value types shared by the subcommands: a bad value is a usage error (exit 2, one
line), never a traceback later."""
from __future__ import annotations

import argparse
import os
import tempfile


def _int_at_least(low, expected):
    """An argparse type: an int >= `low`, `expected` naming it in the error."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
seed = _int_at_least(0, "an integer >= 0")


def writable_dir(path, option):
    """A message when folder `path` cannot be made or written (for `option`), else None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot write there ({exc.strerror or exc})"
    return None
