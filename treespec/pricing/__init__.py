"""Pricing: what a tree costs on this machine and what the drafter's promises are worth.

The core decoding loop knows none of this: a policy that prices its trees declares the round
feedback hooks of `treespec.interfaces.TreePolicy` (``plan_round``, ``observe_round``), and the
models here learn through them.

* `hardware` -- the target's dtype chosen by a micro-benchmark, the machine's identity, the cache folder;
* `profile` -- the cost profile: verify seconds per tree size and context, a draft per drafter, cached per machine;
* `cost` -- cost models C_d, C_v(n; ctx) (the convex fit of a profile, presets, files);
* `live_cost` -- a cost model corrected by the round times measured while decoding;
* `calibration` -- how far a drafter's path probabilities can be trusted, fitted and learned live;
* `feedback` -- the round hooks' side: what a priced policy's plan asks and what its live models learn.

Beside the prices, the conditions every measurement here runs under:

* `conditions` -- which cores are free (the run's threads, `ThreadControl`, and the one thread-count
  rule `check_threads`) and whether another process took them during a measurement (`LoadMeter`).
"""
