"""The learner group's arithmetic: one update over N ranks (torch.distributed), its rows and weights shared out. The
runtime starts the ranks on Ray (learner.runtime.learner_group)."""
