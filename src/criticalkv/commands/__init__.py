"""Subcommands of the ``criticalkv`` command, one module each.

A module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; list it
in :data:`criticalkv.cli.COMMANDS`.
"""
