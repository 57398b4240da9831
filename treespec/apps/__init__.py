"""The apps: what is built on the kernel for users.

`api` (`treespec.generate`), `bench` (A/B comparisons), `replay` (offline trace replay), `commands`
and `cli` (the ``treespec`` command), `draw`, `datasets`, `embedded` (the SmolLM2 default),
`methods` (named decoding methods), `selfdistill` (distillation data) and `tiny` (tiny random
targets).  Apps reach policies, drafters, verifiers and scorers through `treespec.registry` only,
never by importing them; the kernel (every other module of ``treespec``) never imports an app.
"""
