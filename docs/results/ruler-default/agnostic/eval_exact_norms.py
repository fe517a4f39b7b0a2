"""Run `criticalkv eval` with the value norms of every Critical-style selection in exact float32,
as the earlier runs in the result folders were (before the bf16 'auto' default)."""

import dataclasses
import sys

from criticalkv.cli import main
from criticalkv.methods import available_methods, get_method, register


def exact(name: str):
    method = get_method(name)
    if hasattr(method.select, "precision"):
        method = dataclasses.replace(method, select=dataclasses.replace(method.select, precision="exact"))
    return method


def constant(method):
    return lambda: method


for name in available_methods():
    register(name, constant(exact(name)))
sys.exit(main(["eval", *sys.argv[1:]]))
