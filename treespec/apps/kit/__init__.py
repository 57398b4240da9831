"""The policy author's kit: checks a new policy, drafter or verifier must pass.

* `testing` -- `check_policy`: the contract every registered policy passes, run on yours;
* `tiny` -- tiny random-weight causal LMs for tests;
* `exactness` -- statistical tests that a sampler's output follows the target's distribution.
"""
