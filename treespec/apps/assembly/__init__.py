"""The run assembly: what a run decodes with and how a method becomes a policy and decoders.

* `session` -- `Session`: the target, its tokenizer, the drafters, the cost source, the machine
  profile and the threads of one run; every app gets its policies and decoders from it, and it
  restores what learning policies learned and saves what the live cost models measured, once;
* `methods` -- the method grammar (``POLICY[@B][+K=V][:DRAFTER][/VERIFIER]``) and `build_policy`;
* `loading` -- one loader of each: the target, its tokenizer, the drafters, a frozen training model;
* `cost_source` -- how cost-aware policies are priced (``--cost-model``);
* `embedded` -- the embedded default target, SmolLM2-135M-Instruct, fetched and converted once.
"""
