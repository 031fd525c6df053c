import numpy as np

from engine.segments import Joiner, segment_schedule, split_text


def words(s: str) -> int:
    return len(s.split())


def test_short_text_is_one_segment():
    assert split_text("Hello there. How are you?", words, max_tokens=80) == ["Hello there. How are you?"]
    assert split_text("a " * 200, words, max_tokens=0) == [("a " * 200).strip()]


def test_sentences_are_merged_up_to_the_limit():
    text = "One two three. Four five six. Seven eight nine. Ten eleven twelve."
    segs = split_text(text, words, max_tokens=6, merge_tokens=0)
    assert segs == ["One two three. Four five six.", "Seven eight nine. Ten eleven twelve."]
    assert all(words(s) <= 6 for s in segs)
    assert " ".join(segs).split() == text.split()


def test_long_sentence_is_cut_at_clauses_then_words_and_short_tail_merges():
    text = "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu, nu. xi"
    segs = split_text(text, words, max_tokens=4, merge_tokens=2)
    assert " ".join(segs).split() == text.split()
    assert all(words(s) <= 4 for s in segs[:-1])
    assert segs[-1].endswith("nu. xi")  # the one-word tail joined the segment before it


def test_chinese_sentences_split_without_spaces():
    segs = split_text("你好。今天天气很好！我们去公园吧。", len, max_tokens=10, merge_tokens=0)
    assert segs == ["你好。今天天气很好！", "我们去公园吧。"]


def test_schedule_per_segment():
    assert segment_schedule(0, (3, 12)) == (3, 12)
    assert segment_schedule(2, (3, 12)) == (12,)


def reference_cross_fade(a, b, fade):
    fade = min(fade, len(a), len(b))
    ramp = np.linspace(0, 1, fade, dtype=np.float32)
    return np.concatenate([a[:-fade], a[-fade:] * (1 - ramp) + b[:fade] * ramp, b[fade:]])


def test_joiner_streams_equal_one_shot_cross_fade():
    rng = np.random.default_rng(0)
    segs = [rng.standard_normal(n).astype(np.float32) for n in (5000, 3000, 4000)]
    ref = reference_cross_fade(reference_cross_fade(segs[0], segs[1], 1200), segs[2], 1200)
    j, out = Joiner(1200), []
    for i, seg in enumerate(segs):
        j.start_segment()
        more = i < len(segs) - 1
        for part in np.array_split(seg, 4 if i != 1 else 7):  # chunks smaller than the fade too
            out.append(j.push(part, more))
    out.append(j.finish())
    got = np.concatenate(out)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_joiner_single_segment_passes_through():
    j = Joiner(1200)
    j.start_segment()
    x = np.arange(100, dtype=np.float32)
    assert np.array_equal(j.push(x, False), x) and j.finish().size == 0
