"""The text front end on fixed inputs. Every expected value here is what the FireRedTTS3 reference
pipeline produced for the same input (its front end, run with wetext and no language-id model);
the suite runs without the reference."""

from __future__ import annotations

import pytest

from engine.frontend import normalization, prepare
from engine.frontend.cleaning import clean
from engine.frontend.language import FastTextLid, detect_by_script
from engine.frontend.normalization import normalize_segment, wetext_pieces
from engine.frontend.sentences import cap_segments, group_sentences, segment_cap, split_sentences
from engine.text import TextTokenizer, write_tiny_tokenizer


def words(s: str) -> int:
    return len(s.split())


@pytest.fixture(scope="module")
def count(tmp_path_factory):
    """Token counts of the tiny checkpoint's tokenizer (the one the integration tests serve)."""
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    tok = TextTokenizer.from_dir(folder)
    return lambda t: len(tok.encode(t))


# ---- cleaning ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, cleaned",
    [
        ("**Note:** see [docs](http://x.io)  \U0001f600\n\nok", "Note: see docs ok"),
        ("# Title\n\n- one\n- two\n* three\n~~gone~~ here", "Title one two three gone here"),
        ("a\u00a0b\u200bc\ufeffd\u2028e\ue000f\ufffdg", "a bcd efg"),  # NBSP, zero-width, BOM, LS, private use
        ("![img](a.png) x*y and 2*3", "x*y and 2*3"),  # mid-line * is arithmetic, kept
        ("  __Bold__ text\n\n\n  *it* \t end  ", "Bold text it end"),
        ("Great job \U0001f389\U0001f44d everyone!", "Great job everyone!"),
        ("bell\x07 and\x00 null", "bell and null"),  # control characters: dropped here (the reference keeps them)
    ],
)
def test_clean(raw, cleaned):
    assert clean(raw) == cleaned


def test_clean_keeps_the_zero_width_joiner_of_an_emoji_sequence():
    # The reference removes the emoji but keeps U+200D, so the tokens still hold it; so do we.
    assert clean("Family \U0001f468\u200d\U0001f469 time") == "Family \u200d time"


# ---- detection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, language",
    [
        ("你好 world", "Chinese"),
        ("こんにちは", "Japanese"),
        ("今日はカタカナ", "Chinese"),  # any Han character wins over kana, as in the reference
        ("안녕하세요", "English"),  # no rule for Hangul or Cyrillic without a language-id model
        ("Привет", "English"),
        ("hello", "English"),
    ],
)
def test_detect_by_script(text, language):
    assert detect_by_script(text) == language


def test_a_missing_language_id_model_is_refused_clearly(tmp_path):
    try:
        import fasttext  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="fasttext package is not installed"):
            FastTextLid(tmp_path / "lid.176.ftz")
    else:
        with pytest.raises(FileNotFoundError, match="lid.176.ftz"):
            FastTextLid(tmp_path / "lid.176.ftz")


# ---- sentences and segments ---------------------------------------------------------------------


def test_sentences_are_grouped_the_reference_way():
    text = "One two three. Four five six. Seven eight nine. Ten eleven twelve."
    sentences = split_sentences(text)
    assert group_sentences(sentences, words, 6, 4, 2) == [
        "One two three. Four five six.",
        " Seven eight nine. Ten eleven twelve.",
    ]


def test_a_segment_closes_only_past_the_minimum():
    text = "a b c d e f g h. i j. k l m n o p q r s t u v w x y z. end"
    got = group_sentences(split_sentences(text), words, 8, 6, 2)
    # the second segment runs far past 8 words: the reference never cuts inside a sentence
    assert got == ["a b c d e f g h.", " i j. k l m n o p q r s t u v w x y z. end"]
    assert group_sentences(split_sentences("Short one. Tiny."), words, 3, 1, 2) == ["Short one. Tiny."]


def test_sentence_ends():
    text = 'Wait... what? He said "Stop." Then left! Pi is 3.14; ok'
    # repeated ends collapse, a closing quote stays with its sentence, 3.14 is one number
    assert split_sentences(text) == ["Wait.", " what?", ' He said "Stop."', " Then left!", " Pi is 3.14;", " ok"]
    assert (
        "".join(group_sentences(split_sentences(text), words, 80, 60, 20))
        == 'Wait. what? He said "Stop." Then left! Pi is 3.14; ok'
    )


def test_chinese_is_split_at_its_own_marks_and_measured_in_characters():
    got = group_sentences(split_sentences("你好。今天天气很好！我们去公园吧、好吗？", chinese=True), len, 6, 4, 3)
    assert got == ["你好。今天天气很好！", "我们去公园吧、", "好吗？"]


def test_an_overlong_segment_is_cut_at_clauses_then_spaces_then_characters():
    long = "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu, nu"
    pieces = cap_segments([long], words, 4)
    assert "".join(pieces) == long and all(words(p) <= 4 for p in pieces)
    assert pieces[0] == "alpha beta gamma,"
    assert cap_segments(["甲乙丙丁戊己庚辛"], len, 3) == ["甲乙丙", "丁戊己", "庚辛"]
    assert cap_segments(["short"], len, 3 + 2) == ["short"]
    assert segment_cap(400, 80) == 200 and segment_cap(100, 80) == 80


# ---- normalization ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, language, normalized",
    [
        ("It costs $12.50.", "English", "It costs twelve point five dollars."),
        ("20% & more: a/b|c ~ d", "English", "twenty percent and more, a slash b vertical bar c tilde d"),
        ("He said \u201chi\u201d\u2026", "English", "He said hi..."),
        ("Tom & Jerry; 50/50 ***", "English", "Tom and Jerry, fifty fiftieths asterisk asterisk asterisk"),
        ("我有3个苹果，12.5元", "Chinese", "我有三个苹果，十二点五元"),
        ("Hi 你好 3 个", "English", "Hi你好三个"),  # a Han character picks wetext's Chinese grammar
        ("我哋有3個蘋果。", "Cantonese", "我哋有三個蘋果。"),
        ("Il a 3 pommes.", "French", "Il a 3 pommes."),  # wetext has no French: left as it is
        ("今 天 天气", "German", "今天 天气"),  # CJK spaces are tidied for every language, one pass
    ],
)
def test_normalize_segment(text, language, normalized):
    assert normalize_segment(text, language) == normalized


def test_a_long_segment_goes_through_wetext_in_pieces_cut_only_where_a_sentence_or_clause_ends():
    """wetext keeps the GIL throughout a call: a long segment is normalized piece by piece."""
    text = "It cost $12.50, or 3.5 percent more! Mr. Smith paid 1,000 dollars; 我有3个苹果，12.5元。好的。" * 3
    pieces = wetext_pieces(text, 30)
    assert "".join(pieces) == text and len(pieces) > 6
    assert not any(p.endswith(("3.", "$12.", "1,")) for p in pieces)  # numbers stay whole
    assert all(p[-1] in " ，。" for p in pieces[:-1])
    assert wetext_pieces("a" * 100, 30) == ["a" * 100]  # nowhere to cut: whole


def test_normalizing_in_pieces_says_the_same(monkeypatch):
    text = "It costs $12.50. He paid 1,000 dollars, or 3.5 percent more! Call me at 3:45pm. " * 2
    whole = normalize_segment(text, "English")
    monkeypatch.setattr(normalization, "WETEXT_CHARS", 40)
    assert normalize_segment(text, "English") == whole


# ---- all of it, with the tiny tokenizer -----------------------------------------------------------

EN_PARA = (
    "The committee met on Tuesday to review the budget for the coming year, and after a long discussion "
    "it agreed to fund the new library wing. Construction is expected to begin in the spring, weather "
    "permitting, and should take about eighteen months. Local residents have welcomed the decision, "
    "although some worry about traffic near the school. The mayor promised a public meeting to answer "
    "their questions before any work starts."
)
ZH_PARA = (
    "天色渐渐暗下来的时候，我把最后一件旧毛衣叠好，轻轻放进那只褪色的帆布包里。门锁轻轻一扣，楼道的灯光跟着亮了又灭，"
    "像极了这些年里头起起落落的日常。我站在台阶上深吸了口气，冷空气顺着鼻腔往里钻，带着点泥土与枯叶的腥气。"
)


@pytest.mark.parametrize(
    "text, language, expected_language, segments",
    [
        ("The meeting is at 10:30 tomorrow.", "english", "English", ["The meeting is at ten thirty tomorrow."]),
        ("She was born on May 5th, 2024.", None, "English", ["She was born on May fifth, twenty twenty four."]),
        ("Dr. Smith lives on St. James Street.", "auto", "English", ["doctor Smith lives on St. James Street."]),
        ("**Note:** read the [docs](http://example.com/docs) first.\n\n- item one\n- item two", "English", "English",
         ["Note, read the docs first. item one item two"]),
        ("Choose A/B testing & compare results... carefully - really.", "English", "English",
         ["Choose A B testing and compare results. carefully - really."]),
        ("会议定于2024年5月5日上午10:30开始。", "Chinese", "Chinese", ["会议定于二零二四年五月五日上午十点三十分开始。"]),
        ("今天气温是25°C，湿度60%。", None, "Chinese", ["今天气温是二十五摄氏度，湿度百分之六十。"]),
        ("こんにちは、元気ですか？", None, "Chinese", ["、元気？"]),  # Han wins, then wetext's Chinese grammar drops kana
        ("Bonjour à tous, il est 10:30.", None, "English", ["Bonjour tous, il est ten thirty."]),
        ("Das kostet 5 Euro. Bis morgen!", "German", "German", ["Das kostet 5 Euro. Bis morgen!"]),
        (EN_PARA, None, "English", [
            ("The committee met on Tuesday to review the budget for the coming year, and after a long discussion it "
             "agreed to fund the new library wing."),
            "Construction is expected to begin in the spring, weather permitting, and should take about eighteen months.",
            "Local residents have welcomed the decision, although some worry about traffic near the school.",
            "The mayor promised a public meeting to answer their questions before any work starts.",
        ]),
        (ZH_PARA, None, "Chinese", [ZH_PARA[: ZH_PARA.index("我站")], ZH_PARA[ZH_PARA.index("我站") :]]),
    ],
)  # fmt: skip
def test_prepare_matches_the_reference(count, text, language, expected_language, segments):
    got = prepare(text, language, count)
    assert got.language == expected_language
    assert got.segments == segments


def test_other_languages_keep_the_space_that_starts_a_sentence(count):
    text = "Le conseil s'est réuni mardi soir pour examiner le budget de l'année prochaine. " * 3
    got = prepare(text.strip(), "French", count)
    assert len(got.segments) > 1 and all(s.startswith(" ") for s in got.segments[1:])


def test_normalization_can_be_turned_off(count):
    got = prepare("I have 3 apples... **ok**", "English", count, normalize=False)
    assert got.segments == ["I have 3 apples. **ok**"]  # cleaned and split, not normalized
    assert prepare("I have 3 apples", "English", count, normalize=False).segments == ["I have 3 apples"]
    assert prepare("I have 3 apples... ok", "English", count, split_tokens=0).segments == ["I have three apples... ok"]


@pytest.mark.parametrize("text", ["", "   \n\t ", "\U0001f600\U0001f389", "\u200b\ufeff", "![img](a.png)", "# \n- \n"])
def test_nothing_to_speak_names_text(count, text):
    with pytest.raises(ValueError, match="^TEXT: nothing to speak after cleaning$"):
        prepare(text, None, count)


def test_unknown_language_is_refused(count):
    with pytest.raises(ValueError, match="unknown language 'Klingon'"):
        prepare("Hello", "Klingon", count)


def test_an_overlong_sentence_is_cut_to_fit_max_patches(count):
    sentence = "word " * 300 + "end."
    got = prepare(sentence, "English", count, max_patches=400)
    assert len(got.segments) > 1
    assert all(count(s) <= 200 for s in cap_segments([clean(sentence)], count, 200))
    assert " ".join(got.segments).split() == sentence.split()
