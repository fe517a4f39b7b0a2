"""``criticalkv methods``: the registered methods, one line each."""

from __future__ import annotations

import argparse

NAME = "methods"
HELP = "list the registered methods"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from criticalkv.methods import available_methods, get_method

    width = max(len(name) for name in available_methods())
    for name in available_methods():
        m = get_method(name)
        print(f"{name:<{width}}  {m.description}  [{m.reference}]")
    return 0
