"""A reward that every rank but rank 1 can import: a plugin file that one node lacks."""

import os

if os.environ.get("RANK") != "1":
    def reward(args, sample) -> float:
        return 0.0
