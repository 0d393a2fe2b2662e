"""Rollout-side scheduling: ``build_schedule`` (``planner``) and the ``Schedule`` record with its
invariant checks (``schedule``), the packing and balancing kernels (``kernels``,
``rank_balance``), the FLOPs model, per-step reports and synthetic workloads."""
