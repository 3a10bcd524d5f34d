"""Emitter: UTF-8 holding, stop strings, EOS, num_predict, the reasoning budget, frames."""

from __future__ import annotations

import random

import pytest

from runner.emit import Emitter, Step


class Sink:
    """Collects ``send`` calls as frames; an empty content is a bug."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, list[int], list | None]] = []

    def __call__(self, content: str, ids: list[int], logprobs: list | None) -> None:
        assert content, "send() called with empty content"
        self.frames.append((content, list(ids), logprobs))

    @property
    def text(self) -> str:
        return "".join(f[0] for f in self.frames)

    @property
    def ids(self) -> list[int]:
        return [i for f in self.frames for i in f[1]]


def run(tok, ids, **options) -> tuple[Sink, list[Step], Emitter]:
    """Push ids until a step finishes (else call finish); the decoder's loop, minus the model."""
    sink = Sink()
    emitter = Emitter(tok, send=sink, **options)
    steps = []
    for token in ids:
        steps.append(emitter.push(token))
        if steps[-1].finished:
            break
    else:
        emitter.finish()
    return sink, steps, emitter


def answer_up_to_stop(tok, ids, stops) -> tuple[int | None, str]:
    """(index of the token completing the first stop, decoded answer before it), by brute force."""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return i, text[: min(hits)]
    return None, tok.decode(ids)


def ids_for_bytes(tok, *parts: bytes) -> list[int]:
    """Token ids whose bytes are exactly each part (looked up in the tokenizer's byte table)."""
    table = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    return [table[p] for p in parts]


@pytest.fixture(scope="module")
def tiny_tok(tiny_checkpoint):
    from runner.loader import load_model

    return load_model(tiny_checkpoint).tokenizer


@pytest.fixture(params=["tiny", "default"])
def tok(request):
    if request.param == "tiny":
        return request.getfixturevalue("tiny_tok")
    return request.getfixturevalue("default_loaded").tokenizer


def emoji_ids(tok) -> list[int]:
    """'😀' as three tokens, none of which is valid UTF-8 alone."""
    ids = tok.encode("😀")
    if len(ids) != 3:
        data = "😀".encode()
        ids = ids_for_bytes(tok, data[:1], data[1:2], data[2:])
    assert len(ids) == 3 and b"".join(tok.token_bytes(i) for i in ids) == "😀".encode()
    for i in ids:
        with pytest.raises(UnicodeDecodeError):
            tok.token_bytes(i).decode("utf-8")
    return ids


# -- streaming and UTF-8 ------------------------------------------------------------------------

TEXTS = [
    "Hello 😀 world, café naïve 日本語 — done.",
    "The quick brown fox jumps over the lazy dog. 1, 2, 3!",
    "def add(a, b):\n    return a + b\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_plain_stream_equals_decode(tok, text):
    ids = tok.encode(text)
    sink, steps, emitter = run(tok, ids)
    assert sink.text == text == tok.decode(ids)
    assert sink.ids == ids
    assert not any(s.finished for s in steps)
    assert emitter.generated == len(ids) and emitter.emitted == ids
    # Every frame's ids cover its text: the ids sent so far decode to at least the text so far.
    sent_text, sent_ids = "", []
    for content, frame_ids, logprobs in sink.frames:
        sent_text += content
        sent_ids += frame_ids
        assert tok.decode(sent_ids).startswith(sent_text)
        assert logprobs is None


def test_emoji_split_across_three_tokens(tok):
    a = tok.encode("A")
    pieces = emoji_ids(tok)
    sink = Sink()
    em = Emitter(tok, send=sink)
    em.push(a[0])
    assert sink.frames == [("A", a[:1], None)]
    em.push(pieces[0])
    em.push(pieces[1])
    assert len(sink.frames) == 1  # incomplete bytes are held
    em.push(pieces[2], logprob="lp2")
    assert sink.frames[1] == ("😀", pieces, [None, None, "lp2"])


def test_logprobs_ride_with_their_text(tok):
    pieces = emoji_ids(tok)
    ids = tok.encode("ok") + pieces
    sink = Sink()
    em = Emitter(tok, send=sink)
    for i, token in enumerate(ids):
        em.push(token, logprob={"i": i})
    em.finish()
    assert sink.ids == ids
    assert [lp for f in sink.frames for lp in f[2]] == [{"i": i} for i in range(len(ids))]
    assert sink.frames[-1][0] == "😀"


def test_cut_off_character_at_the_end_is_rendered_like_decode(tok):
    pieces = emoji_ids(tok)
    ids = tok.encode("hi") + pieces[:2]
    sink, _, _ = run(tok, ids)
    assert sink.text == tok.decode(ids) and sink.text.startswith("hi")
    assert sink.ids == ids


# -- EOS and num_predict ------------------------------------------------------------------------


def test_eos_stops_without_streaming_or_counting(tok):
    eos = min(tok.eos_ids)
    ids = tok.encode("Hi there") + [eos] + tok.encode("never")
    sink, steps, em = run(tok, ids)
    assert steps[-1] == Step(finished=True, reason="stop", keep=False)
    assert len(steps) == len(tok.encode("Hi there")) + 1
    assert sink.text == "Hi there" and eos not in sink.ids
    assert em.generated == len(steps) - 1 and em.emitted[-1] == eos


def test_custom_eos_ids(tok):
    ids = letters(tok, "abc")
    sink, steps, em = run(tok, ids, eos_ids=[ids[1]])
    assert steps[-1].finished and not steps[-1].keep and len(steps) == 2
    assert sink.text == tok.decode(ids[:1])


@pytest.mark.parametrize("limit", [0, 1, 7])
def test_num_predict(tok, limit):
    ids = tok.encode("one two three four five six seven eight nine ten eleven twelve")
    assert len(ids) > 8
    sink, steps, em = run(tok, ids, max_tokens=limit)
    if limit == 0:
        assert not any(s.finished for s in steps) and len(steps) == len(ids)
        assert sink.text == tok.decode(ids)
        return
    assert len(steps) == limit and em.generated == limit
    assert steps[-1] == Step(finished=True, reason="length", keep=True)
    assert not any(s.finished for s in steps[:-1])
    assert sink.text == tok.decode(ids[:limit])


def test_eos_is_not_counted_against_num_predict(tok):
    eos = min(tok.eos_ids)
    sink = Sink()
    em = Emitter(tok, send=sink, max_tokens=2, eos_ids=[eos])
    first = tok.encode("a")[0]
    assert not em.push(first).finished
    assert em.push(eos).reason == "stop"
    assert em.generated == 1


def test_length_end_releases_held_stop_prefix(tok):
    ids = tok.encode("x END")
    sink, steps, _ = run(tok, ids, stop=["END!"], max_tokens=len(ids))
    assert steps[-1].reason == "length"
    assert sink.text == "x END"


def test_eos_releases_held_stop_prefix(tok):
    ids = tok.encode("x END") + [min(tok.eos_ids)]
    sink, steps, _ = run(tok, ids, stop=["END!"])
    assert steps[-1].reason == "stop" and not steps[-1].keep
    assert sink.text == "x END"


# -- stop strings ---------------------------------------------------------------------------------


def check_stop(tok, ids, stops):
    sink, steps, em = run(tok, ids, stop=stops)
    index, answer = answer_up_to_stop(tok, ids, stops)
    assert sink.text == answer
    if index is None:
        assert not any(s.finished for s in steps)
    else:
        assert len(steps) == index + 1
        assert steps[-1] == Step(finished=True, reason="stop", keep=True)
    return sink, steps, em


def test_stop_spanning_token_boundaries(tok):
    ids = tok.encode("Hello world, stop here please")
    sink, steps, _ = check_stop(tok, ids, ["world, st"])
    assert sink.text == "Hello "
    assert "w" not in sink.text


def test_stop_held_text_is_never_streamed(tok):
    ids = tok.encode("abc<|x y|>tail")
    sink = Sink()
    em = Emitter(tok, send=sink, stop=["<|x y|>"])
    for token in ids:
        step = em.push(token)
        assert "<" not in sink.text
        if step.finished:
            break
    assert step.finished and sink.text == "abc"


def test_stop_inside_a_multibyte_character(tok):
    pieces = emoji_ids(tok)
    ids = tok.encode("go ") + pieces + tok.encode(" on")
    sink = Sink()
    em = Emitter(tok, send=sink, stop=["o 😀"])
    steps = [em.push(t) for t in ids[: len(ids) - len(tok.encode(" on"))]]
    # Matches only once the character is complete: on the third emoji token.
    assert [s.finished for s in steps[-3:]] == [False, False, True]
    assert sink.text == "g"
    # A stop made of the character's bytes: the match needs the decoded character.
    data = "日".encode()
    ids = tok.encode("a") + ids_for_bytes(tok, data[:1], data[1:2], data[2:]) + tok.encode("b")
    check_stop(tok, ids, ["日"])


def test_overlapping_stop_strings(tok):
    ids = tok.encode("hello world again")
    # Both complete on the same token: the earliest start wins.
    sink, _, _ = check_stop(tok, ids, ["world", "o w"])
    assert sink.text == "hell"
    sink, _, _ = check_stop(tok, ids, ["o w", "world"])
    assert sink.text == "hell"
    # The first to complete ends generation.
    sink, _, _ = check_stop(tok, ids, ["world again", "ld"])
    assert sink.text == "hello wor"


def test_text_is_held_while_any_stop_could_match(tok):
    ids = tok.encode("xab") + tok.encode("c")
    sink = Sink()
    em = Emitter(tok, send=sink, stop=["abz", "bq"])
    for token in ids[:-1]:
        em.push(token)
    assert sink.text == "x"
    em.push(ids[-1])
    assert sink.text == "xabc"


def test_random_streams_match_brute_force(tok):
    rng = random.Random(7)
    corpus = " ".join(TEXTS) + " café café 😀😀 stop stop."
    for _ in range(40):
        start = rng.randrange(len(corpus) - 20)
        text = corpus[start : start + rng.randrange(10, 60)]
        ids = tok.encode(text)
        if rng.random() < 0.3:  # raw byte-level noise, including split characters
            ids += [rng.randrange(tok.vocab_size) for _ in range(5)]
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randrange(1, 6)] if rng.random() < 0.7 else "zz~q")
        ids = [t for t in ids if t not in tok.eos_ids]
        sink, steps, em = check_stop(tok, ids, stops)
        assert em.emitted == ids[: len(steps)]


# -- reasoning budget ------------------------------------------------------------------------------


def letters(tok, word: str) -> list[int]:
    """One token per character (single ASCII characters are always one token)."""
    out = []
    for ch in word:
        ids = tok.encode(ch)
        assert len(ids) == 1
        out += ids
    return out


def push_all(em, ids) -> list[Step]:
    return [em.push(t) for t in ids]


def test_think_budget_fires_on_the_nth_content_token(tok):
    open_ids, close = tok.encode("<think>"), tok.encode("</think>")
    sink = Sink()
    em = Emitter(tok, send=sink, think_budget=3)
    steps = push_all(em, open_ids + letters(tok, "abc"))
    assert [s.forced for s in steps[:-1]] == [[]] * (len(steps) - 1)
    assert steps[-1] == Step(forced=close)
    assert sink.text == "<think>abc</think>"
    assert sink.frames[-1][1][-len(close) :] == close
    assert em.generated == len(open_ids) + 3
    assert em.emitted == open_ids + letters(tok, "abc") + close
    # The model repeats the close after a newline: the duplicate marker is dropped.
    steps = push_all(em, tok.encode("\n") + close + letters(tok, "ok"))
    em.finish()
    assert not any(s.forced or s.finished for s in steps)
    assert sink.text == "<think>abc</think>\nok"
    # The dropped marker's ids reach no frame; every other id does, in order.
    assert sink.ids == open_ids + letters(tok, "abc") + close + tok.encode("\n") + letters(
        tok, "ok"
    )


def test_think_budget_zero_closes_the_span_before_any_content_token(tok):
    sink, open_ids, close = Sink(), tok.encode("<think>"), tok.encode("</think>")
    em = Emitter(tok, send=sink, think_budget=0)
    steps = push_all(em, open_ids)
    assert [s.forced for s in steps] == [[]] * (len(open_ids) - 1) + [close]
    assert em.force_at_start() == []  # the reply opened the span: nothing at the start
    push_all(em, letters(tok, "q"))
    em.finish()
    assert sink.text == "<think></think>q"


def test_think_budget_zero_on_a_prompt_opened_span_forces_before_the_first_token(tok):
    sink, close = Sink(), tok.encode("</think>")
    em = Emitter(tok, send=sink, think_budget=0, prompt_open_think=True)
    assert em.force_at_start() == close
    assert sink.ids == close and sink.text == "</think>"
    assert em.generated == 0 and em.emitted == close
    assert em.force_at_start() == []  # fires once
    steps = push_all(em, letters(tok, "ab"))
    em.finish()
    assert not any(s.forced for s in steps)
    assert sink.text == "</think>ab"


def test_a_positive_budget_never_forces_at_the_start(tok):
    em = Emitter(tok, send=Sink(), think_budget=1, prompt_open_think=True)
    assert em.force_at_start() == []


def test_model_closing_itself_never_fires(tok):
    ids = tok.encode("<think>") + letters(tok, "ab") + tok.encode("</think>") + letters(tok, "xyzw")
    sink, steps, _ = run(tok, ids, think_budget=3)
    assert not any(s.forced for s in steps)
    assert sink.text == tok.decode(ids)


def test_partial_close_defers_the_budget(tok):
    # "</" could start the model's own close: the budget waits, then fires on the next token.
    ids = tok.encode("</") + letters(tok, "xy")
    sink, steps, _ = run(tok, ids, think_budget=1, prompt_open_think=True)
    assert [s.forced for s in steps][-2:] == [tok.encode("</think>"), []]
    assert sink.text == "</x</think>y"


def test_prompt_opened_think_and_leading_whitespace(tok):
    sink, steps, _ = run(tok, letters(tok, "abcd"), think_budget=2, prompt_open_think=True)
    assert [bool(s.forced) for s in steps] == [False, True, False, False]
    assert sink.text == "ab</think>cd"
    ws64 = letters(tok, " " * 32 + "\n" * 32)
    ids = ws64 + tok.encode("<think>") + letters(tok, "abcd")
    _, steps, _ = run(tok, ids, think_budget=2)
    assert [bool(s.forced) for s in steps].count(True) == 1
    _, steps, _ = run(tok, letters(tok, " ") + ids, think_budget=2)
    assert not any(s.forced for s in steps)
    # A marker later in the answer is not a reasoning span.
    _, steps, _ = run(
        tok, letters(tok, "x") + tok.encode("<think>") + letters(tok, "abcd"), think_budget=1
    )
    assert not any(s.forced for s in steps)


@pytest.mark.parametrize(
    "after, shown",
    [
        ("\n</think>", "\n"),  # the duplicate marker goes, the whitespace stays
        (" \n", " \n"),  # only whitespace
        ("x</think>", "x</think>"),  # not immediate
        (" " * 9 + "</think>", " " * 9 + "</think>"),  # too much whitespace
        ("</thin>", "</thin>"),  # divergent
        ("</think></think>", "</think>"),  # only one duplicate is dropped
    ],
)
def test_only_an_immediate_duplicate_close_is_dropped(tok, after, shown):
    ids = letters(tok, "a") + tok.encode(after) + letters(tok, "b")
    sink, steps, _ = run(tok, ids, think_budget=1, prompt_open_think=True)
    assert steps[0].forced == tok.encode("</think>")
    assert sink.text == "a</think>" + shown + "b"


def test_text_held_after_a_forced_close_is_released_at_finish(tok):
    ids = letters(tok, "a") + tok.encode(" \n</thi")
    sink, _, _ = run(tok, ids, think_budget=1, prompt_open_think=True)
    assert sink.text == "a</think> \n</thi"


def test_forced_close_skipped_when_the_token_ends_generation(tok):
    ids = tok.encode("<think>") + letters(tok, "abc")
    sink, steps, em = run(tok, ids, think_budget=2, max_tokens=len(ids) - 1)
    assert steps[-1] == Step(finished=True, reason="length")
    assert sink.text == "<think>ab" and em.emitted == ids[:-1]
