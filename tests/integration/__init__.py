"""Integration tests: the simulators, the policies (lerobot's VLAs included) and the learner and rollout actor in one
process, without Ray."""
