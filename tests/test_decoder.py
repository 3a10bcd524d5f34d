"""The pipelined plain decoder with a scripted fake model: ordering, forwards, cache ledgers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache.kv import KVCache
from runner.decoder import DecodeLoop, PlainDecoder, PlainLoop
from runner.emit import Emitter
from runner.loader import load_model
from runner.prefill import chunk_ends, prefill
from runner.sampler import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0, repeat_penalty=1.0, top_k=0, top_p=1.0)


def decode_plain(loop: PlainLoop, last_prompt: int, cancelled):
    """Pipelined plain decoding from the last prompt token until the emitter, the budget or a
    cancel ends it: the decode loop without a drafter."""
    decode = DecodeLoop(loop, loop.start(last_prompt), cancelled)
    while (outcome := decode.step()) is None:
        pass
    return outcome


class ScriptedModel:
    """Next token after cache position p is ``script[p]``; logs every forward in order."""

    def __init__(self, script: list[int], vocab: int, log: list) -> None:
        self.script = script
        self.vocab = vocab
        self.log = log

    def make_caches(self) -> list[KVCache]:
        return [KVCache(), KVCache()]

    def hidden(self, tokens: mx.array, caches: list[KVCache]) -> mx.array:
        start, length = caches[0].offset, tokens.shape[1]
        self.log.append(("forward", start, tokens))
        for c in caches:
            kv = mx.zeros((1, 1, length, 1))
            c.update_and_fetch(kv, kv)
        # Encode the absolute position in the hidden so unembed can look the script up.
        pos = mx.arange(start, start + length, dtype=mx.float32)
        return mx.broadcast_to(pos[None, :, None], (1, length, 4))

    def unembed(self, hidden: mx.array) -> mx.array:
        pos = hidden[..., 0].astype(mx.int32)
        table = mx.array(self.script, dtype=mx.int32)
        return 10.0 * (mx.arange(self.vocab)[None] == table[pos][..., None]).astype(mx.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_model(tiny_checkpoint).tokenizer


def run_script(tokenizer, prompt, answer, *, max_tokens=0, stop=(), cancel_after=None):
    """Decode with the scripted model; return (outcome, events, caches, model)."""
    log: list = []
    eos = next(iter(tokenizer.eos_ids))
    script = [0] * (len(prompt) - 1) + list(answer) + [eos] * 8
    model = ScriptedModel(script, tokenizer.vocab_size, log)
    caches = model.make_caches()
    prefill(model, caches, prompt[:-1], 0, chunk=4)
    sampler = Sampler(GREEDY, history=prompt, vocab_size=tokenizer.vocab_size, context_length=512)
    emitted: list[int] = []

    def send(content, ids, logprobs):
        log.append(("emit", list(ids)))
        emitted.extend(ids)

    emitter = Emitter(tokenizer, stop=list(stop), max_tokens=max_tokens, send=send)
    dec = PlainDecoder(model, caches, sampler)
    cancelled = lambda: cancel_after is not None and len(emitted) >= cancel_after  # noqa: E731
    loop = PlainLoop(dec, emitter, max_tokens=max_tokens, context_length=512)
    outcome = decode_plain(loop, prompt[-1], cancelled)
    emitter.finish()
    return outcome, log, caches, dec


def fed_tokens(log) -> list[list[int]]:
    return [e[2].reshape(-1).tolist() for e in log if e[0] == "forward"]


def test_one_forward_per_token_and_dispatch_before_emit(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    answer = tokenizer.encode("The quick brown fox")
    outcome, log, caches, dec = run_script(tokenizer, prompt, answer)
    eos = next(iter(tokenizer.eos_ids))
    assert outcome.reason == "stop" and outcome.fed == answer and outcome.final == eos
    # Prefill (chunks of 4) + seed + one forward per answer token + the EOS dispatched early.
    decode_forwards = fed_tokens(log)[-(len(answer) + 2) :]
    assert decode_forwards == [[prompt[-1]]] + [[t] for t in answer] + [[eos]]
    assert dec.forwards == len(answer) + 2
    # The forward that feeds token n is dispatched before token n is emitted.
    events = [(e[0], e[2].reshape(-1).tolist() if e[0] == "forward" else e[1]) for e in log]
    for token in answer:
        fwd = events.index(("forward", [token]))
        emit = next(i for i, e in enumerate(events) if e[0] == "emit" and token in e[1])
        assert fwd < emit
    # EOS was fed by the in-flight forward and rewound: caches hold prompt + answer exactly.
    assert all(c.offset == len(prompt) + len(answer) for c in caches)


def test_budget_does_not_feed_the_last_token(tokenizer):
    prompt = tokenizer.encode("hello there")
    answer = tokenizer.encode(" one two three four five six seven eight")
    for budget in (1, 2, 7):
        outcome, log, caches, dec = run_script(tokenizer, prompt, answer, max_tokens=budget)
        assert outcome.reason == "length"
        assert outcome.fed == answer[: budget - 1] and outcome.final == answer[budget - 1]
        assert dec.forwards == budget  # seed + budget - 1 fed tokens
        assert all(c.offset == len(prompt) + budget - 1 for c in caches)


def test_stop_string_keeps_the_completing_token(tokenizer):
    prompt = tokenizer.encode("hello there")
    answer = tokenizer.encode("The capital of France is Paris. The capital")
    outcome, log, caches, _ = run_script(tokenizer, prompt, answer, stop=["Paris"])
    assert outcome.reason == "stop"
    text = tokenizer.decode(outcome.fed)
    assert text.endswith("Paris") or "Paris" in tokenizer.decode(outcome.fed[-2:])
    # Caches hold tokens up to and including the one that completed the match.
    assert "Paris" not in tokenizer.decode(outcome.fed[:-1])
    assert all(c.offset == len(prompt) + len(outcome.fed) for c in caches)
    assert outcome.final == answer[len(outcome.fed)]
    streamed = [e[1] for e in log if e[0] == "emit"]
    assert "Paris" not in tokenizer.decode([t for ids in streamed for t in ids][-1:])


def test_cancel_leaves_caches_at_emitted_tokens(tokenizer):
    prompt = tokenizer.encode("hello there")
    answer = tokenizer.encode(" one two three four five six seven eight nine ten")
    outcome, log, caches, _ = run_script(tokenizer, prompt, answer, cancel_after=3)
    assert outcome.reason == "cancelled"
    emitted = [t for e in log if e[0] == "emit" for t in e[1]]
    # Everything fed was emitted; the caches never hold a token the host was not told about.
    assert outcome.fed == emitted[: len(outcome.fed)] and len(outcome.fed) <= len(emitted)
    assert all(c.offset == len(prompt) + len(outcome.fed) for c in caches)
    assert outcome.final == answer[len(outcome.fed)]


def test_chunk_ends():
    assert chunk_ends(0, 10, 4) == [4, 8, 10]
    assert chunk_ends(3, 10, 4) == [7, 10]
    assert chunk_ends(0, 4, 512) == [4]
    assert chunk_ends(0, 8, 4) == [4, 8]
    # With an opening, a chunk ends there too wherever a prompt crosses it.
    assert chunk_ends(0, 600, 512, 16) == [16, 528, 600]
    assert chunk_ends(3, 40, 512, 16) == [16, 40]
    assert chunk_ends(0, 40, 12, 16) == [12, 16, 28, 40]
    assert chunk_ends(16, 40, 512, 16) == [40] and chunk_ends(0, 16, 512, 16) == [16]
