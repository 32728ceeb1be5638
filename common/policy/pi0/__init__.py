"""The pi0 and pi0.5 backends (policy.type pi0, pi05), laid out as lerobot lays out its policies: `config` (the policy.pi0
section, free of torch and lerobot), `model` (PiFlowPolicy over lerobot's PI0Policy / PI05Policy) and `stand_ins` (the
tiny variants, the offline tokenizer and a random-weight lerobot checkpoint, for CPU runs, tests and benchmarks).
Importing the package imports none of them."""
