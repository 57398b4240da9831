"""Drafters: block-parallel models (DFlash, Domino) and test drafters with known distributions."""
