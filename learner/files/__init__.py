"""The run's files: its directory, checkpoints, the manifest of what started it, and the files each node must hold."""
