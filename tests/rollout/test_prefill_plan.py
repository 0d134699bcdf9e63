"""The chunked-prefill plan (rollout/requests.py:prefill_plan): which rows one right-padded forward takes and how many
tokens of each, against hand-worked cases and the invariants of any plan."""

import random

from rollout.requests import prefill_plan


def test_rows_of_like_length_go_together_and_the_oldest_always_goes():
    # two prompts of 120 fill a budget of 256 with 16 padded positions; a 6-token turn beside them would pad to 120
    assert prefill_plan(list("abcdef"), [120, 6, 120, 6, 6, 120], 256) == (["a", "c"], [120, 120])
    # the oldest is a short turn: it goes, beside the row that wastes the least of its width
    assert prefill_plan(list("ab"), [6, 120], 256) == (["a", "b"], [6, 120])
    # a lone prompt longer than the budget is chunked to the budget
    assert prefill_plan(["a"], [1000], 256) == (["a"], [256])


def test_what_fits_whole_goes_in_one_forward():
    # five prompts of 6-26 tokens pad to 130 positions: all of them, though width 21 would waste less (the 26-token
    # row's last 5 would then need a forward of their own)
    assert prefill_plan(list("abcde"), [6, 11, 16, 21, 26], 256) == (list("abcde"), [6, 11, 16, 21, 26])
    # past the budget the rule does not apply: 3 rows of 120 cannot go whole
    assert prefill_plan(list("abc"), [120, 120, 120], 256) == (["a", "b"], [120, 120])


def test_many_short_turns_beat_one_wide_row_and_long_rows_are_chunked_to_their_width():
    # 40 prompts of 120 behind a 6-token turn, 49 more turns: at width 6 a forward takes 42 rows (252 real tokens of
    # 252 positions); at width 120 only two rows (one of them the padded turn: 126 real of 240)
    reqs = list(range(90))
    rows, n = prefill_plan(reqs, [6] + [120] * 40 + [6] * 49, 256)
    assert rows == list(range(42)) and n == [6] * 42


def test_any_plan_fits_the_budget_takes_the_oldest_and_never_more_than_is_left():
    rng = random.Random(0)
    for _ in range(500):
        k, budget = rng.randint(1, 40), rng.choice([8, 64, 256, 512])
        left = [rng.choice([1, 2, 6, 30, 120, 700]) for _ in range(k)]
        rows, n = prefill_plan(list(range(k)), left, budget)
        assert rows[0] == 0 and rows == sorted(set(rows))
        assert len(rows) * max(n) <= budget  # padded positions, not real tokens, are what the budget bounds
        assert all(1 <= m <= left[r] for r, m in zip(rows, n))
        # rows cut short are cut to the forward's width: a chunk never leaves padding in its own row
        assert all(m == max(n) for r, m in zip(rows, n) if m < left[r])
