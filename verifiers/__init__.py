"""Verifiers: lossless match verification and chain rejection sampling."""
