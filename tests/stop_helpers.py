"""What a stop does to a response, engine by engine (the HF engine's tests and the vLLM ones).

Both compare two generations of the same prompts with the same per-request seeds, so the
draws are the same and a stopped response is exactly the unstopped one cut after its stop.
"""

from vime_shell.engines.base import stop_string_end


def assert_cut_at_token(before: list, after: list, stop_id: int) -> list[int]:
    """``after`` (``stop_id`` a stop token) is ``before`` (it is not) cut right after the
    first ``stop_id``, finishing with "stop"; responses without it are unchanged. Returns the
    indices of the responses ``before`` ran past the stop (at least one)."""
    ran_past = [i for i, g in enumerate(before) if stop_id in g.token_ids[:-1]]
    assert ran_past, "no sample drew the stop token mid-response: the test would show nothing"
    for b, a in zip(before, after):
        if stop_id in b.token_ids:
            cut = b.token_ids.index(stop_id) + 1
            assert (a.token_ids, a.finish_reason) == (b.token_ids[:cut], "stop")
            assert max((abs(x - y) for x, y in zip(a.log_probs, b.log_probs)), default=0) < 1e-5
        else:
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert all(len(after[i].token_ids) < len(before[i].token_ids) for i in ran_past)
    return ran_past


def assert_cut_at_string(free: list, cut: list, decode, stop: str) -> int:
    """``cut`` (``stop`` a stop string) keeps each ``free`` response up to and including the
    token that completed ``stop``; returns how many responses held it (at least one)."""
    hits = 0
    for f, c in zip(free, cut):
        end = stop_string_end(f.token_ids, decode, (stop,))
        if end is None:
            assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason)
            continue
        hits += 1
        assert (c.token_ids, c.finish_reason) == (f.token_ids[:end], "stop")
        assert stop in decode(c.token_ids) and stop not in decode(c.token_ids[:-1])
    assert hits >= 1
    return hits
