"""argparse value types shared by the subcommands: a bad value is a usage error (exit 2, one
line), never a traceback later."""
from __future__ import annotations

import argparse
import os
import tempfile


def positive_int(text):
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seed(text):
    """An int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def writable_dir(path, option):
    """A message when folder `path` cannot be made or written (for `option`), else None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot write there ({exc.strerror or exc})"
    return None
