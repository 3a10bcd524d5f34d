"""A request's image layout (runner.images): 3-channel positions, the RoPE tables they give,
feature rows over the pads, their release once every reader passed, and prefix-cache keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache
from cache.session import PrefixCache
from runner.images import IMAGE_KEY_BIT, ImageLayout, ImageSpan, image_key, prompt_positions
from runner.models.rope import RoPE, mrope_channels


def span(index: int, start: int, grid: tuple[int, int], key: int = 7, image=None) -> ImageSpan:
    return ImageSpan(index, start, grid, IMAGE_KEY_BIT | key, image if image else object())


def two_images() -> tuple[int, list[ImageSpan]]:
    """5 text, start, 3x4 pads, end, 4 text, start, 6x2 pads, end, 6 text: 43 rows."""
    first = span(0, 6, (3, 4))
    second = span(1, first.end + 1 + 4 + 1, (6, 2))
    return second.end + 1 + 6, [first, second]


def brute_positions(length: int, spans: list[ImageSpan]) -> tuple[np.ndarray, int]:
    """Positions row by row, straight from the rule: a text row one past the previous row's
    largest channel; an image's rows (t, t + row, t + column) with t one past the row before
    the image."""
    out = np.zeros((3, length), dtype=np.int64)
    nxt, i = 0, 0
    while i < length:
        image = next((s for s in spans if s.start == i), None)
        if image is None:
            out[:, i] = nxt
            nxt += 1
            i += 1
            continue
        rows, cols = image.grid
        for r in range(rows):
            for c in range(cols):
                out[:, i] = (nxt, nxt + r, nxt + c)
                i += 1
        nxt += max(rows, cols)
    return out, int(out.max()) + 1 - length


def test_positions_follow_the_rule_and_the_delta_accumulates():
    length, spans = two_images()
    positions, delta = prompt_positions(length, spans)
    assert (length, delta) == (43, -14)
    assert positions[:, 6].tolist() == [6, 6, 6] and positions[:, 7].tolist() == [6, 6, 7]
    assert positions[:, spans[1].end - 1].tolist() == [16, 21, 17]
    assert positions[:, spans[1].end].tolist() == [22, 22, 22]  # the end token: text
    rng = np.random.default_rng(0)
    for _ in range(50):  # random layouts against the row-by-row rule
        spans, at = [], int(rng.integers(0, 4))
        for index in range(int(rng.integers(0, 4))):
            at += 1  # the start token
            s = span(index, at, (int(rng.integers(1, 5)), int(rng.integers(1, 5))))
            spans.append(s)
            at = s.end + 1 + int(rng.integers(0, 3))
        length = at + int(rng.integers(1, 4))
        got, delta = prompt_positions(length, spans)
        want, want_delta = brute_positions(length, spans)
        assert np.array_equal(got, want) and delta == want_delta


def test_rows_past_the_prompt_sit_at_index_plus_delta_and_plain_ranges_are_found():
    length, spans = two_images()
    layout = ImageLayout(length, spans, encode=lambda image: None)
    across = layout.rows(length - 2, 5)  # two prompt rows, three generated ones
    assert across[:, :2].tolist() == layout.positions[:, -2:].tolist()
    assert across[0, 2:].tolist() == [length + layout.delta + i for i in range(3)]
    assert layout.plain_start(length + 10, 3) == length + 10 + layout.delta
    assert layout.plain_start(0, 5) == 0  # text before the first image
    assert layout.plain_start(spans[0].end, 6) == 10  # its end token and the text after
    assert layout.plain_start(5, 3) is None  # start token into the image
    assert layout.plain_start(spans[0].start, 2) is None


def test_multimodal_tables_equal_plain_tables_on_text_rows_and_read_their_channels():
    rope = RoPE(8, base=1e6, head_dim=32)
    sections = (2, 1, 1)
    assert mrope_channels(4, sections).tolist() == [0, 1, 2, 0]  # T, H, W, T
    assert mrope_channels(32, (11, 11, 10)).tolist().count(1) == 11
    plain = rope.tables(17, 4)
    same = rope.multimodal_tables(np.tile(np.arange(17, 21), (3, 1)), sections)
    for a, b in zip(plain, same, strict=True):
        assert mx.array_equal(a, b).item()  # bit-identical: the same float ops
    positions = np.array([[5, 5, 5], [5, 6, 7], [5, 9, 5]])  # t, h, w of three image rows
    cos = np.array(rope.multimodal_tables(positions, sections)[0])
    periods = np.array(rope._period_table)
    for j, channel in enumerate([0, 1, 2, 0]):
        expected = np.cos(positions[channel] / periods[j]).astype(np.float32)
        assert np.allclose(cos[:, j], expected, atol=1e-6)
        assert np.allclose(cos[:, j + 4], expected, atol=1e-6)  # rotate-half duplicates
    assert (cos[:, 8:] == 1).all()  # partial rotary: the rest pass unchanged


class Image:
    def __init__(self, rows: int, dim: int, seed: int) -> None:
        self.pixels = np.zeros((4 * rows, 3), dtype=np.float32)
        self.features = mx.array(np.random.default_rng(seed).normal(size=(rows, dim)), mx.float32)


def test_overlay_writes_feature_rows_over_pads_in_any_chunking_and_encodes_once():
    length, spans = two_images()
    for s in spans:
        s.image = Image(s.rows, 4, s.index)
    encoded = []

    def encode(image):
        encoded.append(image)
        return image.features

    layout = ImageLayout(length, spans, encode)
    layout.reads("draft")
    embedded = mx.array(np.arange(length * 4, dtype=np.float32).reshape(1, length, 4))
    whole = np.array(layout.overlay(embedded, 0, "target"))[0]
    for s in spans:
        assert np.array_equal(whole[s.start : s.end], np.array(s.features))
        assert np.array_equal(whole[s.start - 1], np.array(embedded[0, s.start - 1]))
        assert np.array_equal(whole[s.end], np.array(embedded[0, s.end]))
    assert len(encoded) == 2 and all(s.image is None for s in spans)  # pixels dropped
    # The draft head reads the same rows a chunk at a time, chunks ending inside images.
    pieces = []
    for lo, hi in [(0, 9), (9, 23), (23, length)]:
        pieces.append(np.array(layout.overlay(embedded[:, lo:hi], lo, "draft"))[0])
    assert np.array_equal(np.concatenate(pieces), whole)
    assert len(encoded) == 2


def test_features_are_held_until_every_reader_passed_the_image():
    length, spans = two_images()
    for s in spans:
        s.image = Image(s.rows, 4, s.index)
    layout = ImageLayout(length, spans, lambda image: image.features)
    layout.reads("draft")
    rows = mx.zeros((1, length, 4))
    layout.overlay(rows[:, : spans[0].end + 2], 0, "target")
    assert spans[0].features is not None and layout.nbytes > 0
    layout.overlay(rows, 0, "target")  # the target is past both images
    assert all(s.features is not None for s in spans)  # the head is not
    layout.overlay(rows[:, 1 : spans[0].end + 1], 1, "draft")
    assert spans[0].released and spans[0].features is None
    assert spans[1].features is not None
    layout.release()
    assert layout.nbytes == 0 and all(s.released for s in spans)


def test_image_keys_stay_off_the_token_range_and_key_the_pad_rows():
    assert image_key(b"a") != image_key(b"b")
    assert image_key(b"a") == image_key(b"a")
    assert all(image_key(bytes([i])) >= IMAGE_KEY_BIT for i in range(64))
    length, spans = two_images()
    layout = ImageLayout(length, spans, lambda image: None)
    prompt = list(range(length))
    keys = layout.key_tokens(prompt)
    assert keys[: spans[0].start] == prompt[: spans[0].start]
    assert set(keys[spans[0].start : spans[0].end]) == {spans[0].key}
    assert keys[spans[0].end] == prompt[spans[0].end]


@pytest.mark.parametrize("pair", [False, True])
def test_prefix_cache_matches_the_same_image_and_misses_another(pair):
    caches = [KVCache()]
    prefix = PrefixCache(caches, 1 << 30, pair_keys=pair)
    prompt = [1, 2, 3, 50, 50, 50, 4, 5, 6]  # 50: the pad id of one image at rows 3..5

    def run(keys, tail):
        session = prefix.begin(prompt, keys=keys)
        feed = prompt[session.cached :]
        k = mx.zeros((1, 1, len(feed) + len(tail), 2))
        caches[0].update_and_fetch(k, k)
        session.record(tail)
        cached = session.cached
        session.close()
        return cached

    image = [1, 2, 3, *[IMAGE_KEY_BIT | 9] * 3, 4, 5, 6]
    other = [1, 2, 3, *[IMAGE_KEY_BIT | 8] * 3, 4, 5, 6]
    assert run(image, [7]) == 0
    assert run(image, [7]) == len(prompt) - 1  # the same image: the whole prompt
    # Another image: only the text before it (with pair keys, the draft slot before the
    # image depends on the image's first row too).
    assert run(other, [7]) == (2 if pair else 3)
    with pytest.raises(ValueError, match="keys"):
        prefix.begin(prompt, keys=image[:-1])
