"""What produces a rollout's batch: the colocated producer (``rollouts``), engines on ranks of
their own (``remote``: the trainer's client and the engine ranks' server), the fully-async pool
(``pool``, ``pool_parts``), the weight-sync probe (``probe``) and replayed dumps (``replay``).
Reads ``settings``; imports nothing of ``train``, ``run`` or ``cli``."""
