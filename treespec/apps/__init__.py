"""The apps: what is built on the kernel for users, in wings.

* `api` -- ``treespec.generate``; `cli` and `commands` -- the ``treespec`` command, one module per
  subcommand;
* `assembly` -- the run assembly every app stands on: the `Session` (policies and decoders of a run),
  the method grammar, the loaders, the cost source, the embedded default;
* `bench` (A/B comparisons), `replay` (offline trace replay), `published` (papers' tables from their
  raw records), `training` (the drafter-training loop);
* `data` -- benchmark prompts, distillation data, the committed data store, continuous batching;
* `drawing` -- trees as pictures and the trace page;
* `kit` -- the policy author's checks (`check_policy`), tiny random targets, exactness tests.

Apps reach policies, drafters, verifiers and scorers through `treespec.registry` only, never by
importing them; the kernel (every other module of ``treespec``) never imports an app.
"""
