"""The rollout data model: ``Sample`` (``sample``), validation and flattening of rollout output
(``rollout_output``), the columnar ``RolloutBatch`` and its checks (``batch``, ``convert``,
``columns``, ``ragged``), advantages (``rewards``) and the trainer's micro-batch records
(``microbatch``)."""
