"""End-to-end tests: `learner.main` and the other commands on a local Ray, marked `slow` by this directory."""
