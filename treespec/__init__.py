"""treespec: tree-based speculative decoding with block-parallel drafters.

The core package holds the tree, the interfaces, the decoding loop and the tools around them.
Policies, drafters and verifiers live in their own top-level packages and are reached by name
through `treespec.registry`, never imported here.
"""

from treespec.apps.api import generate
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

__all__ = [
    "BACKENDS", "ConditionalScorer", "DraftContext", "DraftOutput", "DraftTree", "Drafter", "Expansion",
    "GenerationResult", "GenerationStats", "RoundStats", "SamplingParams", "TreeError", "TreePolicy",
    "Verifier", "VerifyResult", "available", "create", "generate", "register", "resolve",
]
