"""Agents in, training samples out: an OpenAI-compatible session server in front of the run's
engine (``server``), each execution's sessions as token trees whose leaves become one group of
samples (``sessions``), and the agent contract of ``--custom-agent-function-path`` (``agent``).
"""
