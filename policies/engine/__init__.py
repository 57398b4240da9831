"""The build engine every best-first policy shares (no policy lives here).

* `candidates` -- what a policy hands the engine: its children as data (`TopTokens`, `FactorizedSource`,
  `ScorerSource`) and the contract they follow;
* `best_first` -- the policy base `BestFirstPolicy`, the networkx reference (a Python heap);
* `frontier` -- the vectorized torch expander (compact on the CPU, static elsewhere);
* `stacked` -- S drafts' trees grown in one batched build;
* `cuda_graph` -- a static build captured in a CUDA graph;
* `stop` -- early stopping in pop order (`StopRule`); `cost` -- the cost-aware rule and mixin.
"""
