"""The run on Ray: the driver's loop, its start-up, the rollout actors' pool, the learner's actor and handle, monitoring, the cluster."""
