"""The step: one rollout's batch through the trainer: the share exchange (``exchange``), the
record's batch fields (``records``), off-policy corrections (``offpolicy``) and the weight-sync
gap check (``weight_check``). Imports nothing of ``run`` or ``cli``."""
