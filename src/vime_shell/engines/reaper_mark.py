"""The mark of the thread that ends a rank after a health verdict, torch-free.

``engines.health`` starts that thread (not a daemon, so it outlives the main thread it waits
for) and marks it; ``vime train``'s exit (``cli.train``) leaves a marked thread to end the
process and reports any other live non-daemon thread as a plugin's. The CLI reads the mark
without importing ``engines.health``, which imports torch (a launch error and ``--dry-run``
never import torch).
"""

REAPER_NAME = "vime-health-exit"
ENDS_PROCESS = "vime_ends_process"  # the attribute that marks it
