"""The tiny instruct-shaped model of the shell tests: :mod:`vime_shell.models.chat_model`."""

from vime_shell.models.chat_model import CORPUS, QWEN_TEMPLATE, SPECIALS, build_chat_model

__all__ = ["CORPUS", "QWEN_TEMPLATE", "SPECIALS", "build_chat_model"]
