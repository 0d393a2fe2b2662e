"""``check_token_ids``: every token id of a batch within the model's embedding rows."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs
from vime_pure import RolloutBatch, TokenIdError, check_token_ids


@given(rollout_outputs(), st.integers(1, 60_000))
def test_raises_exactly_when_an_id_is_outside_and_names_the_first(output, vocab):
    """Theorem: one vectorised comparison over the flat token column finds every id outside
    ``[0, vocab)``, and the offsets map the first one back to its sample and position."""
    batch = RolloutBatch.from_samples(output)
    outside = (batch.tokens < 0) | (batch.tokens >= vocab)
    if not outside.any():
        check_token_ids(batch, vocab)
        return
    flat = int(np.argmax(outside))
    sample = int(np.searchsorted(batch.token_offsets, flat, side="right") - 1)
    with pytest.raises(TokenIdError) as info:
        check_token_ids(batch, vocab, source="rollout 7")
    message = str(info.value)
    assert message.startswith(f"rollout 7: sample {sample} ")
    assert f"tokens[{flat - batch.token_offsets[sample]}]={batch.tokens[flat]} " in message
    assert f"[0, {vocab})" in message and "Fix:" in message


def test_the_reserved_pad_row_is_inside_and_the_next_id_outside():
    """The embedded model: 19 tokenizer ids plus a reserved pad row make 20 embedding rows."""
    from vime_pure import Sample

    batch = RolloutBatch.from_samples([[Sample(tokens=[3, 19], response_length=1, reward=1.0)]])
    check_token_ids(batch, 20)
    with pytest.raises(TokenIdError, match=r"tokens\[1\]=19 \(response token\) is outside "
                                           r"the vocabulary \[0, 19\)"):
        check_token_ids(batch, 19)
