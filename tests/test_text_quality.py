"""Repetition metrics: hand-computed replies (looping, fluent, short, case and punctuation),
properties, bad input, and the demo's repetition line."""

from __future__ import annotations

import pytest

from hf_memory.metrics.text_quality import distinct_n, repeated_ngram_fraction, repetition, words

LOOPING = "I'm so anxious, I am so anxious. I am so anxious, I am so anxious."


def test_words_lowercase_and_keep_inner_apostrophes():
    assert words("I'm SO anxious, isn’t it? rock'n'roll_2 -- ok!") == [
        "i'm", "so", "anxious", "isn’t", "it", "rock'n'roll_2", "ok"]
    assert words("  ...  ") == []


def test_a_looping_reply():
    # 15 words: i'm so anxious + 4 x (i am so anxious) minus the first "i am"
    # bigrams (14): i'm-so, so-anxious, anxious-i, i-am, am-so, then those four again and again
    assert distinct_n(LOOPING) == pytest.approx(5 / 14)
    # 4-grams (12): the first 5 are new, the remaining 7 repeat one of positions 1-4
    assert repeated_ngram_fraction(LOOPING) == pytest.approx(7 / 12)
    assert distinct_n(LOOPING, 4) == pytest.approx(5 / 12)


def test_definitional_cases():
    assert repeated_ngram_fraction("a b c d a b c d") == pytest.approx(1 / 5)
    assert repeated_ngram_fraction("a a a a a") == pytest.approx(1 / 2)  # aaaa twice
    assert distinct_n("a a a a a") == pytest.approx(1 / 4)
    assert distinct_n("a b a b", n=1) == pytest.approx(2 / 4)
    assert repeated_ngram_fraction("a b c d e f g h") == 0.0  # five new 4-grams


def test_a_reply_with_no_repeats():
    fluent = "I plan my week on Sunday and then follow the schedule."
    assert distinct_n(fluent) == 1.0 and repeated_ngram_fraction(fluent) == 0.0


def test_short_replies_have_nothing_to_repeat():
    for text in ("", "Paris.", "   "):
        assert distinct_n(text) == 1.0 and repeated_ngram_fraction(text) == 0.0
    assert repeated_ngram_fraction("so so so") == 0.0  # three words: no 4-gram
    assert distinct_n("so so so") == pytest.approx(1 / 2)


def test_case_and_punctuation_do_not_make_ngrams_distinct():
    assert distinct_n("Yes, yes. YES! yes?") == pytest.approx(1 / 3)
    assert repeated_ngram_fraction("One two three four. one, TWO -- three; four!") == \
        pytest.approx(1 / 5)


def test_repetition_averages_per_reply():
    result = repetition([LOOPING, "a b c d a b c d", "Paris."])
    assert result["replies"] == 3
    assert result["distinct_2"] == pytest.approx((5 / 14 + 4 / 7 + 1.0) / 3)
    assert result["repeated_4gram"] == pytest.approx((7 / 12 + 1 / 5 + 0.0) / 3)
    assert repetition(("x y",)) == {"distinct_2": 1.0, "repeated_4gram": 0.0, "replies": 1}


@pytest.mark.parametrize(("texts", "message"), [
    ([], "at least one reply"),
    ("a looping reply", "not one string"),
    (["fine", None], "entry 1 is NoneType"),
    (["fine", 3], "entry 1 is int"),
])
def test_repetition_rejects_bad_input(texts, message):
    with pytest.raises(ValueError, match=message):
        repetition(texts)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_n_must_be_a_positive_integer(n):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        distinct_n("a b c", n)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        repeated_ngram_fraction("a b c", n)


def test_exported_from_the_package():
    import hf_memory

    assert hf_memory.repetition is repetition and "distinct_n" in hf_memory.__all__


def test_saying_a_reply_twice_can_lower_its_repeated_share():
    """Why the property below starts at two copies: a reply's repeated-4-gram share can fall
    when it is said twice (its boundary adds new 4-grams)."""
    once = "a a a a a a a a a b"  # 7 4-grams, 2 distinct
    twice = f"{once} {once}"  # 17 4-grams, 5 distinct
    assert repeated_ngram_fraction(once) == pytest.approx(5 / 7)
    assert repeated_ngram_fraction(twice) == pytest.approx(12 / 17)
    assert 12 / 17 < 5 / 7


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
replies = st.lists(st.sampled_from(["a", "b", "c", "I'm", "so", "anxious", "."]),
                   max_size=30).map(" ".join)


@hypothesis.given(replies, st.integers(1, 5))
def test_shares_lie_in_zero_one_and_are_complements(text, n):
    distinct, repeated = distinct_n(text, n), repeated_ngram_fraction(text, n)
    assert 0.0 <= distinct <= 1.0 and 0.0 <= repeated <= 1.0
    assert repeated == pytest.approx(1.0 - distinct)
    assert distinct_n(text.upper(), n) == distinct


@hypothesis.given(replies.filter(lambda t: words(t)), st.integers(2, 6))
def test_saying_a_reply_more_often_never_repeats_less(text, k):
    """k >= 2 copies of a reply of m words: the distinct 4-grams are at most m (the text has
    period m), so the share is at least 1 - m / (k m - 3) and grows with k."""
    m = len(words(text))
    more, fewer = (repeated_ngram_fraction(" ".join([text] * c)) for c in (k + 1, k))
    assert more >= fewer
    if k * m >= 4:
        assert fewer >= 1 - m / (k * m - 3) - 1e-12


def _demo_result(quality):
    from hf_memory.metrics.kv_accounting import KVFootprint
    from hf_memory.recipes.demo import DemoResult

    footprint = KVFootprint(num_layers=30, prompt_tokens=10, controlled_layers=2, bank_slots=10,
                            idealised_ratio=15.0, prompt_kv_bytes=2048, bank_bytes=512,
                            actual_ratio=4.0)
    answers = {"plain": ["I am fine, thanks."], "prompt": ["a b c d a b c d"],
               "memory": [LOOPING]}
    return DemoResult(["How are you?"], answers, footprint,
                      dict.fromkeys(answers, 1.0), {3: 1.0},
                      {k: repetition(v) for k, v in answers.items()} if quality else {})


def test_the_demo_prints_each_methods_repetition():
    from hf_memory.recipes.demo import format_demo

    text = format_demo(_demo_result(quality=True))
    assert ("repetition: plain distinct-2 1.00, repeated 4-grams 0.00; prompt distinct-2 0.57, "
            "repeated 4-grams 0.20; memory distinct-2 0.36, repeated 4-grams 0.58") in text
    assert "repetition:" not in format_demo(_demo_result(quality=False))  # built without it


def test_lexicon_rate_counts_whole_words_and_prefixes():
    from hf_memory.metrics.text_quality import lexicon_rate

    # 10 words; "arr" and "matey" whole, "sailin'" by the prefix "sail*"; "seashell" is not "sea"
    replies = ["Arr, matey! I'm sailin' to a seashell.", "Hello there, friend."]
    assert lexicon_rate(replies, ["arr", "matey", "sail*", "sea"]) == pytest.approx(3 / 10)
    assert lexicon_rate(["", "..."], ["arr"]) == 0.0
    with pytest.raises(ValueError, match="lexicon is empty"):
        lexicon_rate(replies, [" "])
    with pytest.raises(ValueError, match="sequence of strings"):
        lexicon_rate("Arr", ["arr"])
