"""Rewards for tests of one error per job: one that every rank but rank 1 can import (a plugin
file that one node lacks), and one that fails on every rank."""

import os

if os.environ.get("RANK") != "1":
    def reward(args, sample) -> float:
        return 0.0


def broken_reward(args, sample) -> float:
    raise ValueError("the reward server is down")
