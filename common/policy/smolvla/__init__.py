"""The SmolVLA backend (policy.type smolvla), laid out as lerobot lays out its policies: `config` (the policy.smolvla
section, free of torch and lerobot), `model` (SmolVLAFlowPolicy over lerobot's SmolVLAPolicy) and `stand_ins` (the tiny
SmolVLM written offline, for CPU runs, tests and benchmarks). Importing the package imports none of them."""
