"""The torch-using parts of the core: per-micro-batch loss reduction over step-level
denominators, per-token policy-loss pieces, and zigzag CP slicing of tensors.

Importing this package imports torch; ``vime_pure`` itself never does.
"""

from vime_pure.torch_ops.cp import slice_packed_response, slice_response, slice_sequence
from vime_pure.torch_ops.loss import (microbatch_loss, microbatch_losses, rejection_mask,
                                     sample_index_from_lengths)
from vime_pure.torch_ops.policy_loss import (PolicyTerms, entropy_from_logits, kl_penalty,
                                             policy_loss, ppo_clip_loss, tis_weights,
                                             token_log_probs)

__all__ = ["PolicyTerms", "entropy_from_logits", "kl_penalty", "microbatch_loss",
           "microbatch_losses", "policy_loss", "ppo_clip_loss", "rejection_mask", "sample_index_from_lengths",
           "slice_packed_response", "slice_response", "slice_sequence", "tis_weights",
           "token_log_probs"]
