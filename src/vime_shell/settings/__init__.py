"""``vime train``'s settings as small records, one per component (see
``vime_shell.settings.train_config`` for how ``TrainConfig`` composes them and where a new knob
goes), with the flag and config-file reader (``flags``), slime's flag table (``slime_flags``),
the Megatron architecture flags (``megatron_args``) and what the launch checks resolved
(``launch_plan``). Below every package that reads them: nothing here imports ``sources``,
``train``, ``run`` or ``cli``."""
