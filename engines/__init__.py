"""Engines a target can run on besides torch (installed as ``treespec.engines``): each is one file,
registered under the registry kind ``"engine"`` and reached through it, never imported by the core."""
