"""Data: prompts to measure on and data to train drafters from.

* `datasets` -- benchmark prompts from the data folder (``$TREESPEC_DATA_DIR``, else the treespec
  cache, filled by ``treespec fetch-data``) or local files, and the chat template;
* `selfdistill` -- distillation data: the target's own answers to prompts;
* `datastore` -- the drafter training data kept in the repository, packed and unpacked;
* `continuous_batch` -- continuous batching of many generations (selfdistill's engine).
"""
