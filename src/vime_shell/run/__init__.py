"""A ``vime train`` run: launch checks (``launch_checks``, ``model_checks``), run directories
and their ownership, checkpoints of a run, reporting and plots, interrupts, ``--debug-rollout-only``
(``rollout_only``), the settings mapped onto engines and trainer (``components``) and the driver
(``driver.run_training``), which runs the rollouts of ``sources`` through the step of ``train``.
Imports nothing of ``cli``."""
