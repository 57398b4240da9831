"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""
