"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""

import torch

# --dtype names shared by the subcommands ("auto": the checkpoint's own dtype); each command
# offers the subset that makes sense for it.
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
CPU_DTYPES = ("bfloat16", "float32")  # the dtypes worth running a target in on a CPU
