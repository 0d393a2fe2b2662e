"""The bridge's NCCL path (separate engine ranks on GPU): the body of ``tests/shell/
test_bridge.py`` with ``backend="nccl"``, so the weights travel over a ``ProcessGroupNCCL``
between two GPUs and arrive on the engine's GPU bit-exact. Needs 2 GPUs (NCCL refuses two
ranks on one device); skips cleanly otherwise."""

import pytest
import torch

from tests.shell.bridge_workers import bridge_worker
from tests.shell.test_bridge import check_roundtrip
from vime_shell.megatron.spawn import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


def test_weights_cross_the_nccl_bridge_bit_exact():
    trainer, engine = spawn(bridge_worker, 2, "nccl", timeout=300)
    check_roundtrip(trainer, engine, "cuda")
