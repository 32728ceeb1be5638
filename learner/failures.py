"""The failures that restart a run's learner or end the run, shared by the actor pool, the learner handle and the command
line (which turns them into one line and exit code 1, keeping the checkpoints), and the stop a scheduler asks for."""


class LearnerDiedError(RuntimeError):
    """The learner actor's process is gone."""


class LearnerWedgedError(LearnerDiedError):
    """The learner did not answer a call within its deadline, and was killed."""


class ActorsExhaustedError(RuntimeError):
    """Fewer rollout actors are left than actors.faults.min_alive."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, as a scheduler stops a job: the run keeps its progress as on Ctrl-C (a checkpoint), then
    `python -m learner.main` exits with 143 (128 + SIGTERM), which a scheduler reads as stopped, not crashed."""
