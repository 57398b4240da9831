"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""

import torch

# --dtype names shared by the subcommands.  "auto": the faster of bf16 and fp32 for the target on
# this CPU, measured once (treespec.hardware), bf16 on CUDA; "checkpoint": the stored dtype.  Each
# command offers the subset that makes sense for it.
DTYPES = {"auto": "auto", "checkpoint": "checkpoint", "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}
CPU_DTYPES = ("auto", "bfloat16", "float32")  # the dtypes worth running a target in on a CPU
