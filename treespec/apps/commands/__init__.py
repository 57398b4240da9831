"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""

from treespec.target import DTYPE_NAMES

# --dtype names shared by the subcommands: the kernel's dtype names, and "auto" (the faster of bf16
# and fp32 for the target on this CPU, measured once (treespec.pricing.hardware), bf16 on CUDA) and
# "checkpoint" (the stored dtype).  Each command offers the subset that makes sense for it.
DTYPES = {"auto": "auto", "checkpoint": "checkpoint", **DTYPE_NAMES}
CPU_DTYPES = ("auto", "bfloat16", "float32")  # the dtypes worth running a target in on a CPU
