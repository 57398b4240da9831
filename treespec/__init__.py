"""treespec: tree-based speculative decoding with block-parallel drafters.

The core package holds the tree, the interfaces, the decoding loop and the tools around them.
Policies, drafters and verifiers live in their own top-level packages and are reached by name
through `treespec.registry`, never imported here.  ``treespec.generate`` (the one-call API of
`treespec.apps.api`) is loaded on first use (PEP 562), so ``import treespec`` -- which every policy,
drafter and verifier does -- loads the kernel only, never an app.
"""

from typing import Any

from treespec.interfaces import (
    BACKENDS,
    ConditionalScorer,
    DraftContext,
    Drafter,
    DraftOutput,
    Expansion,
    SamplingParams,
    TreePolicy,
    Verifier,
    VerifyResult,
)
from treespec.registry import available, create, register, resolve
from treespec.stats import GenerationResult, GenerationStats, RoundStats
from treespec.tree import DraftTree, TreeError

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "generate":  # the apps' one-call API, imported when first asked for
        from treespec.apps.api import generate

        return generate
    raise AttributeError(f"module 'treespec' has no attribute {name!r}")

__all__ = [
    "BACKENDS", "ConditionalScorer", "DraftContext", "DraftOutput", "DraftTree", "Drafter", "Expansion",
    "GenerationResult", "GenerationStats", "RoundStats", "SamplingParams", "TreeError", "TreePolicy",
    "Verifier", "VerifyResult", "available", "create", "generate", "register", "resolve",
]
