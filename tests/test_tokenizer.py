"""Tokenizer rules and the streaming detokenizer (bytes in, complete UTF-8 out, none lost)."""

from __future__ import annotations

import random

import pytest

from runner.loader import load_model
from runner.tokenizer import bytes_to_unicode


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint):
    return load_model(tiny_checkpoint).tokenizer


def test_byte_map_is_a_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256


def test_special_tokens_and_eos_come_from_the_checkpoint(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    start = tiny_tokenizer.hf.token_to_id("<|im_start|>")
    end = tiny_tokenizer.hf.token_to_id("<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tiny_tokenizer.eos_ids == {end}
    assert not tiny_tokenizer.add_bos


def test_decode_round_trips_text(tiny_tokenizer):
    text = "Hello café 😀 — 日本語 <think>x</think> def f():\n    return 1"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_streaming_equals_whole_decode_for_random_token_streams(tiny_tokenizer):
    rng = random.Random(0)
    vocab = tiny_tokenizer.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        stream = tiny_tokenizer.detokenizer()
        text = "".join(stream.add(t) for t in ids) + stream.finish()
        assert text == tiny_tokenizer.decode(ids)


def test_emoji_split_across_three_tokens_is_held_until_complete(tiny_tokenizer):
    emoji = "🎉".encode()  # 4 bytes
    stream = tiny_tokenizer.detokenizer()
    assert stream.add_bytes(emoji[:1]) == ""
    assert stream.add_bytes(emoji[1:2]) == ""
    assert stream.pending == emoji[:2]
    assert stream.add_bytes(emoji[2:] + b"!") == "🎉!"
    assert stream.finish() == ""


def test_cut_off_bytes_are_flushed_not_dropped(tiny_tokenizer):
    stream = tiny_tokenizer.detokenizer()
    assert stream.add_bytes(b"ok\xe6\x97") == "ok"
    assert stream.finish() == "\ufffd"


def test_default_model_tokenizer(default_loaded):
    tok = default_loaded.tokenizer
    prompt = "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids[-1] == 198  # <|im_start|> ... "\n"
    assert tok.decode(ids) == prompt
    # SmolLM2's pre-tokenizer splits digits one by one.
    digits = tok.encode("12345")
    assert len(digits) == 5
    assert tok.eos_ids == {2} and not tok.add_bos
    assert tok.vocab_size == 49152


def test_long_texts_tokenize_alike_and_leave_the_gil_to_other_threads(default_model):
    """Texts past ``GIL_FREE_CHARS`` go through ``encode_batch``: the same ids as ``encode``,
    and another thread keeps running meanwhile (the reader answering control lines while a
    long prompt is tokenized on the preparation thread)."""
    import threading
    import time

    from runner import tokenizer as tokenizer_module

    tok = load_model(default_model).tokenizer
    for size in (tokenizer_module.GIL_FREE_CHARS - 1, tokenizer_module.GIL_FREE_CHARS, 50_000):
        text = ("The quick brown fox, 12 jumps; über naïve café! " * 2000)[:size]
        assert tok.encode(text) == tok.hf.encode(text, add_special_tokens=False).ids
    text = "lorem ipsum dolor sit amet, consectetur 42. " * 40_000
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    start = time.perf_counter()
    tok.encode(text)
    end = time.perf_counter()
    done.set()
    ticker.join()
    during = [t for t in ticks if start < t < end]
    assert end - start < 0.05 or len(during) >= 5, (end - start, len(during))
