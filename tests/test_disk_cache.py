"""The prefix cache's disk tier in process: real files, real engines on small checkpoints.

A restart is a second engine on the same directory once the first released it; every restored
request is compared with the same request served without the disk (token ids and logprobs).
Write faults go through the write hook (``cache.disk_format.fault_hook`` and fakes).
"""

from __future__ import annotations

import errno
import logging
import os
import random

import mlx.core as mx
import numpy as np
import pytest

import cache.disk_format as fmt
from cache.disk import DiskCache
from protocol.frames import Done, Token
from protocol.requests import Completion, Options
from runner.batch import Scheduler
from runner.engine import Engine, EngineOptions

HYBRID = "tests/fixtures/reference/hybrid/qwen3_5_vl"


def complete(engine: Engine, tokens: list[int], n: int = 12):
    """(ids, logprobs of the chosen tokens, done frame) of a greedy completion."""
    request = Completion(
        id="r", tokens=tokens, options=Options(temperature=0, num_predict=n), logprobs=True
    )
    frames: list = []
    engine.run(engine.prepare(request), frames.append, lambda: False)
    done = frames[-1]
    assert isinstance(done, Done) and done.done_reason in ("stop", "length"), done
    entries = [e for f in frames if isinstance(f, Token) for e in f.logprobs or []]
    return [e.id for e in entries], [e.logprob for e in entries], done


def same(a: tuple, b: tuple) -> bool:
    """Two completions' (ids, logprobs) agree: the same tokens, the first token's logprob (the
    forward right after the restore) to the bit, the later ones to float rounding (a decode
    round's shape may differ from run to run with speculation timing)."""
    (ids_a, lp_a), (ids_b, lp_b) = a[:2], b[:2]
    return ids_a == ids_b and lp_a[0] == lp_b[0] and lp_a == pytest.approx(lp_b, abs=1e-5)


def prompt(seed: int, length: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def engine_on(path: str, cache_dir: str | None, **options) -> Engine:
    return Engine(EngineOptions(model_path=path, cache_dir=cache_dir, **options))


def shut(engine: Engine) -> None:
    """The engine's process ends: its writes finish and the directory is released."""
    engine.prefix.disk.close()


def index_of(engine: Engine) -> list[dict]:
    disk = engine.prefix.disk
    disk.flush()
    with open(os.path.join(disk.path, fmt.INDEX), "rb") as f:
        return fmt.decode_index(f.read())["segments"]


def segment_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(("seg-", fmt.TMP_PREFIX)))


@pytest.fixture(scope="module")
def llama(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def uncached(llama) -> Engine:
    return engine_on(llama, None, prefix_cache=False)


# ---------------------------------------------------------------------------- the files
def test_segment_files_round_trip_every_dtype(tmp_path):
    keys = np.array([1, 2**31 + 5, 2**63 + 7, 2**64 - 1], dtype=np.uint64)
    arrays = {
        "f32": mx.random.normal((1, 2, 3, 4)),
        "bf16": mx.random.normal((2, 5)).astype(mx.bfloat16),
        "f16": mx.random.normal((3,)).astype(mx.float16),
    }
    tensors = {"keys": (keys, "U64")} | {n: fmt.to_numpy(a) for n, a in arrays.items()}
    head, chunks = fmt.encode(tensors, {"id": 3})
    digest, size = fmt.write_atomic(str(tmp_path), "x.safetensors", [head, *chunks], "segment")
    data = (tmp_path / "x.safetensors").read_bytes()
    assert size == len(data) == fmt.encoded_size(head, chunks)
    assert digest == fmt.file_digest(data)
    meta, specs = fmt.parse(data)
    assert meta == {"id": 3}
    assert fmt.tensor(data, specs["keys"]).tolist() == keys.tolist()
    for name, array in arrays.items():
        back = fmt.to_mlx(fmt.tensor(data, specs[name]), specs[name][0])
        assert back.dtype == array.dtype and mx.array_equal(back, array).item()
    # Other safetensors readers see the same tensors.
    loaded = mx.load(str(tmp_path / "x.safetensors"))
    assert mx.array_equal(loaded["f32"], arrays["f32"]).item()
    assert segment_files(str(tmp_path)) == []  # no temporary file left


def test_a_failed_write_leaves_neither_file(tmp_path):
    def full(stage):
        raise OSError(errno.ENOSPC, "full")

    with pytest.raises(OSError):
        fmt.write_atomic(str(tmp_path), "x", [b"a" * 10, b"b" * 10], "segment", full)
    assert os.listdir(tmp_path) == []


def test_a_damaged_index_is_refused():
    data = fmt.encode_index({"format": 1, "segments": [{"id": 1}]})
    assert fmt.decode_index(data)["segments"] == [{"id": 1}]
    flipped = data.replace(b'"id": 1', b'"id": 2')
    assert flipped != data
    with pytest.raises(fmt.FormatError, match="checksum"):
        fmt.decode_index(flipped)


# ---------------------------------------------------------------------------- restarts
def test_restart_restores_from_disk_as_from_memory(llama, uncached, tmp_path):
    first, reply = prompt(1, 300), prompt(2, 20)
    engine = engine_on(llama, str(tmp_path))
    ids1, lp1, done1 = complete(engine, first)
    assert done1.prompt_disk_tokens == 0 and done1.prompt_cached_tokens == 0
    second = first + ids1 + reply
    ids2, _, done2 = complete(engine, second)  # its prefix restored from memory
    assert done2.prompt_cached_tokens > len(first) and done2.prompt_disk_tokens == 0
    again2, lp2, done2 = complete(engine, second)  # all of it from memory
    assert again2 == ids2 and done2.prompt_cached_tokens == len(second) - 1
    status = engine.status()
    assert status["disk_segments"] == 2 and status["disk_bytes"] > 0
    shut(engine)

    again = engine_on(llama, str(tmp_path))
    assert again.status()["disk_segments"] == 2
    ids, lp, done = complete(again, second)
    assert done.prompt_disk_tokens == done.prompt_cached_tokens == len(second) - 1
    assert same((ids, lp), (ids2, lp2))  # the bits memory gives
    ids, lp, done = complete(again, first)  # now in memory: nothing more from disk
    assert done.prompt_cached_tokens == len(first) - 1 and done.prompt_disk_tokens == 0
    assert same((ids, lp), (ids1, lp1))
    shut(again)
    assert same(complete(uncached, first), (ids1, lp1))
    assert complete(uncached, second)[0] == ids2


def test_a_branch_continues_a_segment_from_where_it_leaves(llama, uncached, tmp_path):
    shared = prompt(3, 150)
    one, two = shared + prompt(4, 40), shared + prompt(5, 60)
    engine = engine_on(llama, str(tmp_path))
    complete(engine, one)
    complete(engine, two)
    first, branch = index_of(engine)
    assert first["parent"] is None and first["start"] == 0
    assert branch["parent"] == first["id"] and branch["start"] == len(shared)
    shut(engine)

    again = engine_on(llama, str(tmp_path))
    for tokens in (two, one):
        ids, lp, done = complete(again, tokens)
        assert done.prompt_cached_tokens == len(tokens) - 1
        assert same((ids, lp), complete(uncached, tokens))
    shut(again)


@pytest.mark.parametrize("kind", ["sliding-window", "hybrid"])
def test_restart_restores_windows_and_recurrent_states(kind, checkpoint_factory, tmp_path):
    path = checkpoint_factory("mistral", sliding_window=8) if kind == "sliding-window" else HYBRID
    plain = engine_on(path, None, prefix_cache=False)
    first, reply = prompt(6, 90), prompt(7, 9)
    engine = engine_on(path, str(tmp_path))
    assert engine.prefix.disk.windowed
    ids1, _, _ = complete(engine, first)
    second = first + ids1 + reply
    ids2, _, _ = complete(engine, second)
    _, lp2, done2 = complete(engine, second)  # from memory, as deep as it goes
    shut(engine)
    again = engine_on(path, str(tmp_path))
    ids, lp, done = complete(again, second)
    assert done.prompt_disk_tokens == done.prompt_cached_tokens == done2.prompt_cached_tokens > 0
    assert same((ids, lp), (ids2, lp2))
    assert ids == complete(plain, second)[0]
    ids, _, done = complete(again, first)
    assert ids == ids1 and done.prompt_cached_tokens > 0
    shut(again)


# ---------------------------------------------------------------------------- the budget
def test_the_disk_budget_deletes_least_recently_used_segments(llama, tmp_path):
    prompts = [prompt(10 + i, 120) for i in range(4)]
    probe = engine_on(llama, str(tmp_path / "probe"))
    complete(probe, prompts[0])
    size = probe.status()["disk_bytes"]
    shut(probe)

    engine = engine_on(llama, str(tmp_path / "cache"), cache_disk_bytes=int(size * 3.5))
    for tokens in prompts[:3]:
        complete(engine, tokens)
    complete(engine, prompts[0])  # touches the first segment
    complete(engine, prompts[3])  # one has to go: the second, least recently used
    status = engine.status()
    assert status["disk_segments"] == 3 and status["disk_bytes"] <= size * 3.5
    listed = index_of(engine)
    assert sorted(n for n in os.listdir(engine.prefix.disk.path) if n.startswith("seg-")) == [
        f"seg-{e['id']:08d}.safetensors" for e in listed
    ]
    shut(engine)

    again = engine_on(llama, str(tmp_path / "cache"), cache_disk_bytes=int(size * 3.5))
    order = [prompts[0], prompts[2], prompts[3], prompts[1]]  # the evicted one last: it writes
    assert [complete(again, t)[2].prompt_disk_tokens for t in order] == [119, 119, 119, 0]
    shut(again)
    # A smaller budget at the next start deletes down to it, least recently used first.
    small = engine_on(llama, str(tmp_path / "cache"), cache_disk_bytes=int(size * 1.5))
    assert small.status()["disk_segments"] == 1
    shut(small)


# ---------------------------------------------------------------------------- faults
@pytest.mark.parametrize("stage", ["segment", "renamed", "index"])
def test_a_full_disk_drops_the_write_and_the_next_start_is_clean(
    stage, llama, uncached, tmp_path, caplog
):
    kept, lost = prompt(20, 100), prompt(21, 100)
    engine = engine_on(llama, str(tmp_path))
    complete(engine, kept)
    engine.prefix.disk.flush()
    engine.prefix.disk.hook = fmt.fault_hook(f"full:{stage}")
    with caplog.at_level(logging.WARNING, "mtp_runner.disk_cache"):
        ids, lp, _ = complete(engine, lost)
        engine.prefix.disk.flush()
    assert "disk full" in caplog.text
    assert same((ids, lp), complete(uncached, lost))
    disk = engine.prefix.disk
    if stage != "index":
        assert disk.status()["disk_segments"] == 1
        assert disk.budget == disk.status()["disk_bytes"]  # later writes make room first
    shut(engine)

    caplog.clear()
    with caplog.at_level(logging.WARNING, "mtp_runner.disk_cache"):
        again = engine_on(llama, str(tmp_path))
    if stage == "index":  # the segment was written, the index never listed it
        assert "no valid index entry lists" in caplog.text
    again.prefix.disk.flush()  # the index rewritten without what was dropped
    assert len(segment_files(again.prefix.disk.path)) == again.status()["disk_segments"] == 1
    assert complete(again, kept)[2].prompt_disk_tokens == len(kept) - 1
    ids, lp, done = complete(again, lost)
    assert done.prompt_disk_tokens == 0 and same((ids, lp), complete(uncached, lost))
    shut(again)


def test_a_write_failing_once_leaves_later_writes_alone(llama, tmp_path, caplog):
    calls = []

    def flaky(stage):
        calls.append(stage)
        if len(calls) == 1:
            raise OSError(errno.EIO, "input/output error")

    engine = engine_on(llama, str(tmp_path))
    engine.prefix.disk.hook = flaky
    with caplog.at_level(logging.WARNING, "mtp_runner.disk_cache"):
        complete(engine, prompt(30, 80))
        engine.prefix.disk.flush()
    assert "input/output error" in caplog.text
    complete(engine, prompt(31, 80))
    assert index_of(engine)[0]["end"] > 80 and engine.status()["disk_segments"] == 1
    shut(engine)


def corrupt(path: str, how: str) -> None:
    data = bytearray(open(path, "rb").read())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "flipped data":
        data[-100] ^= 0x10
    elif how == "flipped keys":
        _, tensors = fmt.parse(bytes(data))
        data[tensors["keys"][2]] ^= 0x01  # the first key: this prompt would not even match
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    "how", ["truncated", "flipped data", "flipped keys", "missing", "index", "foreign index"]
)
def test_damaged_files_are_skipped_and_never_served(how, llama, uncached, tmp_path, caplog):
    tokens = prompt(40, 200)
    engine = engine_on(llama, str(tmp_path))
    complete(engine, tokens)
    directory = engine.prefix.disk.path
    shut(engine)
    (segment,) = [n for n in os.listdir(directory) if n.startswith("seg-")]
    index = os.path.join(directory, fmt.INDEX)
    if how == "missing":
        os.unlink(os.path.join(directory, segment))
    elif how == "index":
        corrupt(index, "flipped data")
    elif how == "foreign index":
        body = fmt.decode_index(open(index, "rb").read())
        with open(index, "wb") as f:
            f.write(fmt.encode_index({**body, "fingerprint": "another model"}))
    else:
        corrupt(os.path.join(directory, segment), how)
    with caplog.at_level(logging.WARNING, "mtp_runner.disk_cache"):
        again = engine_on(llama, str(tmp_path))
        ids, lp, done = complete(again, tokens)
    assert done.prompt_disk_tokens == 0 and same((ids, lp), complete(uncached, tokens))
    assert again.status()["disk_skipped"] == 1 and "skipped" in caplog.text
    assert again.status()["disk_segments"] == 1  # its own answer, written afresh
    shut(again)


def test_one_runner_per_directory(tmp_path):
    first = DiskCache(str(tmp_path), "f" * 32, ["kv"], 1 << 20, pair_keys=False)
    with pytest.raises(fmt.DirectoryBusy, match=f"pid {os.getpid()}"):
        DiskCache(str(tmp_path), "f" * 32, ["kv"], 1 << 20, pair_keys=False, lock_wait_s=0.2)
    other = DiskCache(str(tmp_path), "e" * 32, ["kv"], 1 << 20, pair_keys=False)  # another model
    first.close()
    DiskCache(str(tmp_path), "f" * 32, ["kv"], 1 << 20, pair_keys=False).close()
    other.close()


def test_the_fingerprint_follows_the_weights_and_settings(checkpoint_factory, tmp_path):
    def directory(path, **options):
        engine = engine_on(path, str(tmp_path), **options)
        shut(engine)
        return os.path.basename(engine.prefix.disk.path)

    base = checkpoint_factory("llama")
    first = directory(base)
    assert directory(base) == first
    assert directory(checkpoint_factory("llama", seed=1)) != first  # other weights, same shapes
    assert directory(base, prefill_chunk=64) != first
    assert directory(base, dtype="float16") != first


def test_concurrent_requests_graft_into_each_others_paths(llama, uncached, tmp_path):
    """Requests admitted together each graft from disk, splitting nodes another slot's live
    path holds; every output equals the uncached one, and so does a later repeat."""
    shared = prompt(60, 120)
    firsts = [shared + prompt(61 + i, 30) for i in range(2)]
    engine = engine_on(llama, str(tmp_path))
    for tokens in firsts:
        complete(engine, tokens)
    shut(engine)

    again = engine_on(llama, str(tmp_path), parallel=3)
    assert again.parallel == 3
    wanted = [firsts[0] + [5, 6], firsts[1] + [7], shared[:70] + [8, 9]]
    scheduler, frames = Scheduler(again), [[] for _ in wanted]
    for tokens, out in zip(wanted, frames, strict=True):
        request = Completion(id="r", tokens=tokens, options=Options(temperature=0, num_predict=8))
        scheduler.admit(again.prepare(request), out.append, lambda: False)
    while any(not out or not isinstance(out[-1], Done) for out in frames):
        scheduler.step()
    # The second splits the first's grafted node (on slot 0's live path) where it leaves it;
    # the third finds its prefix grafted already, in memory.
    assert [out[-1].prompt_disk_tokens for out in frames] == [150, 30, 0]
    assert [out[-1].prompt_cached_tokens for out in frames] == [150, 150, 70]
    for tokens, out in zip(wanted, frames, strict=True):
        ids = [t for f in out if isinstance(f, Token) for t in f.tokens]
        assert ids == complete(uncached, tokens, 8)[0] == complete(again, tokens, 8)[0]
    assert again.prefix.trie.recount() == again.prefix.trie.nbytes
    shut(again)
