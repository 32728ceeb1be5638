"""The update: PPO and GRPO on recorded chains, by one learner (a process of its own, or a rank of a group)."""
