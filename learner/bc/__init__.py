"""Behaviour cloning: the starting policy a run fine-tunes, trained on demonstrations and cached, or read from a lerobot checkpoint."""
