"""Pricing: what a tree costs on this machine and what the drafter's promises are worth.

The core decoding loop knows none of this: a policy that prices its trees gives the decoder a draft
controller (`treespec.interfaces.TreePolicy.draft_controller`, `control` here), and the models here
learn through it.

* `hardware` -- the target's dtype chosen by a micro-benchmark, the machine's identity, the cache folder;
* `profile` -- the cost profile: verify seconds per tree size and context, a draft per drafter, cached per machine;
* `cost` -- cost models C_d, C_v(n; ctx) (the convex fit of a profile, presets, files);
* `live_cost` -- a cost model corrected by the round times measured while decoding;
* `calibration` -- how far a drafter's path probabilities can be trusted, fitted and learned live;
* `control` -- the draft controller: whether each round drafts and at what price, learned from the rounds.

Beside the prices, the conditions every measurement here runs under:

* `conditions` -- which cores are free (the run's threads, `ThreadControl`, and the one thread-count
  rule `check_threads`) and whether another process took them during a measurement (`LoadMeter`).
"""
