"""Subcommands of the ``treespec`` CLI that belong to the drafters package (training tools).

The CLI finds them through the registry (kind ``"command"``), as it would a third-party package's;
each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and imports its heavy
dependencies inside ``run``, so ``treespec --help`` stays fast.
"""
