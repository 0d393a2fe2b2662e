"""``vime train``'s settings as small records, one per component (see ``vime_shell.loop.config``
for how ``TrainConfig`` composes them and where a new knob goes)."""
