"""Lossless speculation on the Qwen3.5 / Qwen3-Next hybrids: recurrent rollback behind the
round driver's seam (fake and real), the checkpoints' own MTP head, and the prefix cache at
turn ends.

Greedy speculation must give plain greedy decoding's tokens and leave the caches in its final
state (offsets, recurrent and attention arrays; float rounding of the verify feeds' chunkwise
recurrence against the one-row step apart), for every budget and depth; with a seed, sampled
speculation gives plain sampling's tokens. Two drafters: a *scripted* head that proposes the
true continuation with errors placed so that every acceptance count 0..k occurs, and the
random MTP head the ``qwen3_5_vl`` fixture ships (``mtp.*``).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import runner.engine as engine_module
import tests.fakes as fakes
import tests.test_rounds as rounds
from cache.recurrent import RecurrentCache
from drafting.head import HeadConfig
from drafting.rounds import TargetError
from runner.engine import Engine, EngineOptions
from runner.faults import Faults
from tests.test_engine import complete
from tests.test_hybrid_models import FIXTURES, reference

GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
SAMPLED = {"temperature": 0.8, "seed": 1234}  # Ollama's other defaults (top-k 40, penalty 1.1)
BUDGETS = [1, 2, 7, 31]
DEPTHS = [1, 2, 4]


# --- a scripted drafter over the real target


class ScriptedHead(nn.Module):
    """A draft head that proposes ``table[S]`` from draft-KV slot S (whose output predicts the
    token at position S + 2): the true continuation, with the errors the test put there. It
    keeps its draft cache's offsets like a real head (one dummy entry per pair) and has no
    weights, so device tuning leaves it alone."""

    def __init__(self, hidden_size: int, vocab: int) -> None:
        super().__init__()
        self.config = HeadConfig(hidden_size=hidden_size, extra={"naming": "scripted"})
        self.vocab = vocab
        self.script: mx.array = mx.zeros((1,), dtype=mx.int32)

    @property
    def feature_width(self) -> int:
        return self.config.hidden_size

    def set_script(self, table: list[int]) -> None:
        self.script = mx.array(table, dtype=mx.int32)

    def __call__(self, tokens: mx.array, hidden: mx.array, cache, mask=None) -> mx.array:
        start, length = cache.offset, tokens.shape[1]
        cache.update_and_fetch(mx.zeros((1, 1, length, 1)), mx.zeros((1, 1, length, 1)))
        slots = mx.arange(start, start + length, dtype=mx.float32)
        return mx.broadcast_to(slots[None, :, None], (1, length, 1))

    def _drafted(self, y: mx.array) -> mx.array:
        slots = mx.clip(y.reshape(-1).astype(mx.int32), 0, self.script.shape[0] - 1)
        return self.script[slots]

    def draft_logits(self, y: mx.array, unembed) -> mx.array:
        """One-hot rows: any sampler draws the scripted token."""
        drafted = self._drafted(y)[:, None]
        columns = mx.arange(self.vocab)[None]
        return mx.where(columns == drafted, 0.0, -mx.inf).astype(mx.float32)


def error_positions(start: int, end: int, depth: int) -> set[int]:
    """Positions whose drafts are wrong: gaps cycling 1 .. depth + 1, so the rounds after each
    rejection accept 0, 1, .., depth drafts in turn (a round at x = p drafts p + 1 ..)."""
    wrong, p, gap = set(), start, 1
    while p < end:
        wrong.add(p)
        p += gap
        gap = gap % (depth + 1) + 1
    return wrong


def script(sequence: list[int], first: int, depth: int, vocab: int) -> list[int]:
    """``table[S]`` = the token at S + 2, wrong at :func:`error_positions` from ``first``."""
    wrong = error_positions(first, len(sequence) + depth + 2, depth)
    table = []
    for slot in range(len(sequence) + depth + 4):
        p = slot + 2
        token = sequence[p] if p < len(sequence) else 0
        table.append((token + 1) % vocab if p in wrong else token)
    return table


@contextlib.contextmanager
def scripted_engine(path, **options):
    """An engine whose draft head is a :class:`ScriptedHead`."""
    loaded = engine_module.load_model(str(path), dtype="float32")
    head = ScriptedHead(loaded.model.args.hidden_size, loaded.model.args.vocab_size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "load_draft_head", lambda loaded, path: (head, "scripted"))
        engine = Engine(EngineOptions(model_path=str(path), **options))
    yield engine, head


def cache_state(engine: Engine) -> list:
    """Every target cache's offset and arrays (what it holds up to its offset)."""
    out = []
    for c in engine.caches:
        if isinstance(c, RecurrentCache):
            out.append((c.offset, np.array(c.conv), np.array(c.recurrent)))
        else:
            out.append(
                (
                    c.offset,
                    np.array(c.keys[..., : c.offset, :]),
                    np.array(c.values[..., : c.offset, :]),
                )
            )
    return out


def assert_same_state(got: list, want: list, case) -> float:
    """Offsets equal, arrays equal to float32 rounding; returns the largest difference."""
    worst = 0.0
    for (offset, *arrays), (want_offset, *wanted) in zip(got, want, strict=True):
        assert offset == want_offset, case
        for a, b in zip(arrays, wanted, strict=True):
            assert a.shape == b.shape, case
            diff = float(np.abs(a - b).max()) if a.size else 0.0
            assert diff <= 1e-4 * max(1.0, float(np.abs(b).max())), (case, diff)
            worst = max(worst, diff)
    return worst


# --- the fake seam with a recurrent layer: every transition and fault row that rolls back


def _cases(name: str, key: str | None = None, values=()) -> list[tuple[str, dict]]:
    return [(name, {key: v}) for v in values] if key else [(name, {})]


ROLLBACK_TESTS = [
    *_cases("test_full_acceptance", "mode", ("greedy", "sampled")),
    *_cases("test_rejection_at_each_depth", "accepted", (0, 1, 2)),
    *_cases("test_accepted_eos_at_each_draft_position", "position", (1, 2)),
    *_cases("test_cancel_at_a_draft_keeps_the_emitted_prefix_before_it"),
    *_cases(
        "test_budget_exhausted_mid_run_commits_the_retained_prefix", "who", ("driver", "emitter")
    ),
    *_cases("test_forced_close_at_x_replays_x_and_the_close_once", "mode", ("sampled",)),
    *_cases("test_forced_close_at_a_draft_feeds_the_close_after_the_retained_run"),
    *_cases("test_forced_close_on_the_last_token_never_draws_a_successor"),
    *_cases("test_head_step_host_failure_rewinds_the_head_and_resumes_next_round"),
    *_cases("test_draft_evaluation_failure_restores_the_entry_and_goes_target_only"),
    *_cases("test_emitter_failure_at_a_draft_reconciles_to_the_emitted_prefix"),
    *_cases(
        "test_coupled_acceptance_accepts_exactly_the_target_s_own_draws", "accepted", (0, 1, 2, 3)
    ),
    *_cases("test_seeded_speculation_is_token_for_token_plain_sampling", "depth", (1, 2, 4)),
    *_cases("test_controller_driven_run_stays_lossless_and_learns"),
]
ROLLBACK_IDS = [f"{n[5:]}-{'-'.join(map(str, k.values()))}".rstrip("-") for n, k in ROLLBACK_TESTS]


@pytest.fixture
def recurrent_fakes(monkeypatch):
    """tests.test_rounds' fake seam with a recurrent layer in every FakeOps it builds (its
    ``check_state`` then also checks the layer's state); yields the seams built."""
    built, original = [], fakes.FakeOps

    def with_layer(*args, **kwargs):
        ops = original(*args, recurrent=True, **kwargs)
        built.append(ops)
        return ops

    monkeypatch.setattr(rounds, "FakeOps", with_layer)
    monkeypatch.setattr(fakes, "FakeOps", with_layer)
    yield built
    assert built and all(ops.recurrent is not None for ops in built)


@pytest.mark.parametrize(("name", "kwargs"), ROLLBACK_TESTS, ids=ROLLBACK_IDS)
def test_round_transitions_with_a_recurrent_layer(recurrent_fakes, name, kwargs):
    getattr(rounds, name)(**kwargs)


@pytest.mark.parametrize("row", list(rounds.FAILURE_ROWS))
def test_failure_rows_with_a_recurrent_layer(recurrent_fakes, row):
    rounds.test_failure_rows(row)


@pytest.mark.parametrize("prompt", [[1, 5, 8], [3], [7, 7, 9, 11, 0, 13]], ids=["p3", "p1", "p6"])
def test_greedy_equivalence_property_with_a_recurrent_layer(recurrent_fakes, prompt):
    rounds.test_greedy_speculation_equals_plain_greedy(prompt)


def test_the_host_cannot_tell_with_a_recurrent_layer(recurrent_fakes):
    rounds.test_the_host_cannot_tell_speculation_happened(fakes.tiny_tokenizer(), [1, 5, 8])


def test_the_fake_recurrent_layer_holds_only_what_was_kept():
    ops = fakes.FakeOps([1, 5, 8], recurrent=True)
    ops.replay_feed([6, 4, 7], successor=False)  # a replay keeps only its start
    with pytest.raises(TargetError, match="holds no state at 4"):
        ops.rewind(4)
    assert ops.fed == [1, 5, 8, 6, 4, 7]
    ops.rewind(3)
    assert ops.fed == [1, 5, 8] and ops.recurrent.offset == 3
    ops.verify_feed(6, None)
    ops.verify_feed(4, fakes.FakeProposal([7, 9]))
    for position in (7, 6, 5):  # every prefix of the verify feed, then its start
        ops.rewind(position)
        assert ops.recurrent.recurrent.item() == fakes.recurrent_state(ops.fed)[1].item()
    ops.rewind(4)
    with pytest.raises(TargetError):
        ops.rewind(3)  # the previous feed's start is gone with the feed after it


# --- the real seam on a real hybrid: every prefix of a verify feed, restore, unfeed


def hybrid(case: str = "qwen3_5_vl"):
    from runner.loader import load_model

    return load_model(str(FIXTURES / case), dtype="float32").model


def greedy_sampler(prompt: list[int], model):
    from runner.sampler import Sampler, SamplingParams

    return Sampler(
        SamplingParams(temperature=0.0, repeat_penalty=1.0),
        prompt,
        model.args.vocab_size,
        model.args.max_position_embeddings,
    )


def states(caches) -> list:
    return [(c.offset, c.conv, c.recurrent) for c in caches if isinstance(c, RecurrentCache)]


def fed_one_by_one(model, tokens: list[int]) -> list:
    """The caches after feeding ``tokens`` one row at a time (plain decoding's steps)."""
    caches = model.make_caches()
    for t in tokens:
        model.hidden(mx.array([[t]]), caches)
        mx.eval([c.state for c in caches])
    return caches


def close(got, want) -> None:
    for (offset, conv, state), (w_offset, w_conv, w_state) in zip(got, want, strict=True):
        assert offset == w_offset
        np.testing.assert_allclose(np.array(conv), np.array(w_conv), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(state), np.array(w_state), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_a_verify_feed_keeps_every_prefix_state_and_its_start(accepted):
    from drafting.mlx_ops import MlxRoundOps
    from drafting.session import Proposal

    model = hybrid()
    prompt, x, drafts = [5, 17, 33, 8, 90], 41, [12, 200, 7]
    caches = fed_one_by_one(model, prompt)
    entry_states = states(caches)
    ops = MlxRoundOps(model, caches, None, greedy_sampler(prompt, model))
    entry = ops.capture()
    verified = ops.verify_feed(x, Proposal(mx.array(drafts), len(prompt) + 1))
    assert len(verified.successors) == 4 and ops.position == len(prompt) + 4
    ops.rewind(entry + 1 + accepted)  # reconcile: no second forward, no replay
    assert all(c.offset == entry + 1 + accepted for c in caches)
    close(states(caches), states(fed_one_by_one(model, prompt + [x, *drafts][: accepted + 1])))
    with pytest.raises(TargetError, match="holds no state"):
        ops.rewind(entry - 1)  # before the feed's start: nothing is kept there
    assert all(c.offset == entry + 1 + accepted for c in caches)  # refused before any moved
    ops.restore(entry)  # the feed's start: the very arrays the entry held
    for (offset, conv, state), (_, want_conv, want_state) in zip(
        states(caches), entry_states, strict=True
    ):
        assert offset == entry and conv is want_conv and state is want_state


def test_a_replay_feed_rewinds_only_to_its_start():
    from drafting.mlx_ops import MlxRoundOps

    model = hybrid()
    caches = fed_one_by_one(model, [5, 17, 33])
    ops = MlxRoundOps(model, caches, None, greedy_sampler([5, 17, 33], model))
    ops.replay_feed([41, 4], successor=True)
    with pytest.raises(TargetError):
        ops.rewind(4)
    ops.rewind(3)
    close(states(caches), states(fed_one_by_one(model, [5, 17, 33])))


def test_the_plain_decoder_unfeeds_an_eos_exactly():
    from runner.decoder import PlainDecoder

    model = hybrid()
    prompt = [5, 17, 33, 8]
    caches = fed_one_by_one(model, prompt[:-1])
    decoder = PlainDecoder(model, caches, greedy_sampler(prompt, model))
    cur = decoder.start(prompt[-1])
    mx.eval(cur.token)
    before = states(caches)
    nxt = decoder.advance(cur)  # dispatched before cur is read: cur is the EOS to drop
    mx.eval(nxt.token)
    decoder.unfeed(nxt)
    for (offset, conv, state), (w_offset, w_conv, w_state) in zip(
        states(caches), before, strict=True
    ):
        assert offset == w_offset == len(prompt) and conv is w_conv and state is w_state


# --- the engine: speculation == plain decoding, tokens and final cache state


@pytest.fixture(scope="module")
def plain_vl():
    path = reference("qwen3_5_vl").path
    return Engine(EngineOptions(model_path=str(path), use_draft=False, prefix_cache=False))


@pytest.fixture(scope="module")
def scripted_vl():
    with scripted_engine(reference("qwen3_5_vl").path, prefix_cache=False) as pair:
        yield pair


@pytest.fixture(scope="module")
def mtp_vl():
    path = reference("qwen3_5_vl").path
    engine = Engine(EngineOptions(model_path=str(path), prefix_cache=False, draft_depth=1))
    assert engine.info.mtp, engine.info.mtp_detail
    return engine


def run_both(plain, spec, prompt, budget, depth, options, head=None, first_error=None):
    """One request on the plain engine and on the speculative one at ``depth`` (scripting
    ``head`` from the plain output when given); returns (ids, spec done, worst difference)."""
    ids, _, done, _ = complete(plain, tokens=prompt, num_predict=budget, **options)
    want = cache_state(plain)
    spec.speculation.fixed_depth = depth
    if head is not None:
        start = len(prompt) + 1 if first_error is None else first_error
        head.set_script(script(prompt + ids, start, depth, spec.info.vocab_size))
    got, _, spec_done, _ = complete(spec, tokens=prompt, num_predict=budget, **options)
    case = (prompt[:3], budget, depth)
    assert got == ids, case
    assert spec_done.done_reason == done.done_reason and spec_done.eval_tokens == len(ids), case
    return ids, spec_done, assert_same_state(cache_state(spec), want, case)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_scripted_speculation_equals_plain_greedy(plain_vl, scripted_vl, budget, depth):
    spec, head = scripted_vl
    for prompt in reference("qwen3_5_vl").prompts:
        _, done, _ = run_both(plain_vl, spec, prompt, budget, depth, GREEDY, head)
        rounds_run = done.speculation.accepted_per_depth
        if budget == 31:  # every acceptance count 0..depth occurred
            assert len(rounds_run) == depth + 1 and all(rounds_run), rounds_run
        if budget > 1:
            assert done.speculation.rounds > 0


@pytest.mark.parametrize("depth", DEPTHS)
def test_scripted_speculation_equals_plain_seeded_sampling(plain_vl, scripted_vl, depth):
    spec, head = scripted_vl
    for prompt in reference("qwen3_5_vl").prompts:
        for seed in (1234, 7):
            opts = {**SAMPLED, "seed": seed}
            _, done, _ = run_both(plain_vl, spec, prompt, 31, depth, opts, head)
            assert done.speculation.accepted > 0


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_checkpoint_mtp_head_speculates_losslessly(plain_vl, mtp_vl, budget, depth):
    for prompt in reference("qwen3_5_vl").prompts:
        _, done, _ = run_both(plain_vl, mtp_vl, prompt, budget, depth, GREEDY)
        if budget > 1:
            assert done.speculation.drafted > 0


def test_the_checkpoint_mtp_head_with_seeded_sampling(plain_vl, mtp_vl):
    for depth in DEPTHS:
        for prompt in reference("qwen3_5_vl").prompts:
            run_both(plain_vl, mtp_vl, prompt, 31, depth, SAMPLED)


# --- the checkpoints' MTP head


def raw_mtp(case: str) -> dict[str, np.ndarray]:
    weights = mx.load(str(FIXTURES / case / "model.safetensors"))
    return {k[len("mtp.") :]: np.array(v) for k, v in weights.items() if k.startswith("mtp.")}


def head_params(head) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


def zero_centred(name: str) -> bool:
    """pre_fc_norm_*, norm and the block's layer and q/k norms: all (1 + w) in Qwen's MTP."""
    return "norm" in name.split(".")[-2]


def test_the_inline_head_is_a_gated_attention_block_with_norms_shifted_once():
    from runner.heads import INLINE_PRENORM_HIDDEN, load_embedded_head
    from runner.loader import load_model
    from runner.models import qwen3_5

    loaded = load_model(str(FIXTURES / "qwen3_5_vl"), dtype="float32")
    head = load_embedded_head(loaded)
    block = head.layers[0]
    assert isinstance(block, qwen3_5.AttentionBlock)
    assert block.self_attn.q_proj.weight.shape[0] == 2 * 4 * 32  # query and gate per head
    assert head.config.prenorm_hidden is INLINE_PRENORM_HIDDEN is False  # post-final-norm
    assert not head.config.hidden_first  # concat(embedding, hidden)
    raw, loaded_params = raw_mtp("qwen3_5_vl"), head_params(head)
    assert set(raw) == set(loaded_params)
    for name, value in raw.items():
        want = value + 1.0 if zero_centred(name) else value
        np.testing.assert_array_equal(loaded_params[name], want.astype(np.float32), name)


def test_an_mlx_conversion_that_kept_the_head_is_not_shifted_again(tmp_path):
    """mlx-lm / mlx-vlm conversions store every zero-centred gain shifted (conv [C, K, 1]):
    the head built from such a checkpoint equals the Hugging Face one's."""
    import shutil

    from runner.heads import load_embedded_head
    from runner.loader import load_model

    source = FIXTURES / "qwen3_5_mlx"
    for name in source.iterdir():
        if name.suffix in (".json",):
            shutil.copy(name, tmp_path / name.name)
    weights = dict(mx.load(str(source / "model.safetensors")))
    for name, value in raw_mtp("qwen3_5_vl").items():
        shifted = value + 1.0 if zero_centred(name) else value
        weights["mtp." + name] = mx.array(shifted)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    converted = load_embedded_head(load_model(str(tmp_path), dtype="float32"))
    original = load_embedded_head(load_model(str(FIXTURES / "qwen3_5_vl"), dtype="float32"))
    got, want = head_params(converted), head_params(original)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], name)


@pytest.mark.parametrize(
    ("case", "key"),
    [("qwen3_next_dense", "num_nextn_predict_layers"), ("qwen3_5_mlx", "mtp_num_hidden_layers")],
)
def test_a_declared_but_stripped_head_is_reported(case, key):
    engine = Engine(EngineOptions(model_path=str(FIXTURES / case), compile=False))
    assert not engine.info.mtp
    assert "declares an MTP head" in engine.info.mtp_detail and key in engine.info.mtp_detail
    assert "stripped" in engine.info.mtp_detail
    ids, _, _, _ = complete(engine, tokens=reference(case).prompts[0], num_predict=8, **GREEDY)
    assert ids == reference(case).greedy[0].tolist()[:8]


def test_a_head_failure_mid_request_never_fails_it(plain_vl):
    """The head fails on its 3rd call: the request goes on target-only, the caches are levelled
    where every cache (recurrent layers included) can go, and the output is plain's."""
    path = reference("qwen3_5_vl").path
    engine = Engine(EngineOptions(model_path=str(path), draft_depth=2, faults=Faults(head_call=3)))
    for prompt in reference("qwen3_5_vl").prompts:
        want, _, _, _ = complete(plain_vl, tokens=prompt, num_predict=20, **GREEDY)
        got, _, done, _ = complete(engine, tokens=prompt, num_predict=20, **GREEDY)
        assert got == want and done.done_reason == "length"
        offsets = {c.offset for c in engine.all_caches}
        assert len(offsets) == 1, offsets


# --- the prefix cache at turn ends


@pytest.fixture(scope="module")
def uncached_vl():
    path = reference("qwen3_5_vl").path
    return Engine(EngineOptions(model_path=str(path), use_draft=False, prefix_cache=False))


def chat_engine(draft: bool, cache_bytes: int | None = None) -> Engine:
    options = EngineOptions(
        model_path=str(reference("qwen3_5_vl").path),
        use_draft=draft,
        prefill_chunk=8,
        draft_depth=2 if draft else None,
        cache_bytes=cache_bytes,
    )
    return Engine(options)


def user_turn(i: int) -> list[int]:
    return [2, *reference("qwen3_5_vl").prompts[i % 3][:10]]  # EOS closes the answer


def check_budget(engine: Engine) -> None:
    pc = engine.prefix
    assert pc.nbytes <= pc.budget_bytes and pc.nbytes == pc.trie.recount()
    assert len({c.offset for c in engine.all_caches}) == 1


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_each_chat_turn_resumes_at_the_previous_answer_end(uncached_vl, draft):
    engine, conversation = chat_engine(draft), list(reference("qwen3_5_vl").prompts[0])
    restored, previous = [], 0
    for turn in range(3):
        ids, _, done, _ = complete(engine, tokens=conversation, num_predict=16, **SAMPLED)
        want, _, _, _ = complete(uncached_vl, tokens=conversation, num_predict=16, **SAMPLED)
        assert ids == want, turn
        restored.append(done.prompt_cached_tokens)
        if turn:  # all of the previous prompt and answer but its last token, never fed
            assert done.prompt_cached_tokens == previous - 1, turn
        previous = len(conversation) + len(ids)
        conversation = conversation + ids + user_turn(turn)
        check_budget(engine)
    assert restored[0] == 0 and restored[1] > 0


def test_a_regenerated_or_edited_turn_resumes_at_the_prompt_or_answer_end(uncached_vl):
    """Other requests in between: the states come from trie snapshots, not the live caches."""
    engine = chat_engine(draft=True)
    first = list(reference("qwen3_5_vl").prompts[2])
    answer, _, _, _ = complete(engine, tokens=first, num_predict=12, **GREEDY)
    second = first + answer + user_turn(1)
    complete(engine, tokens=second, num_predict=12, **GREEDY)
    complete(engine, tokens=reference("qwen3_5_vl").prompts[1], num_predict=5, **GREEDY)
    for prompt, cached in [
        (second, len(second) - 1),  # regenerated: all of the prompt but the token that seeds
        (first + answer + user_turn(2), len(first) + len(answer) - 1),  # last message edited
    ]:
        ids, _, done, _ = complete(engine, tokens=prompt, num_predict=12, **SAMPLED)
        want, _, _, _ = complete(uncached_vl, tokens=prompt, num_predict=12, **SAMPLED)
        assert ids == want and done.prompt_cached_tokens == cached
        check_budget(engine)


@pytest.mark.parametrize("budget", [40_000, 120_000])
def test_memory_accounting_holds_under_a_small_budget(uncached_vl, budget):
    """A recurrent snapshot of this fixture is ~31 KB (three layers): the budget holds one or
    a few; conversations, branches and regenerations stay exact and within it."""
    engine = chat_engine(draft=True, cache_bytes=budget)
    prompts = reference("qwen3_5_vl").prompts
    conversation = list(prompts[0])
    for turn in range(6):
        prompt = conversation if turn % 3 else list(prompts[turn % 3]) + user_turn(turn)
        ids, _, done, _ = complete(engine, tokens=prompt, num_predict=10, **GREEDY)
        want, _, _, _ = complete(uncached_vl, tokens=prompt, num_predict=10, **GREEDY)
        assert ids == want, turn
        assert 0 <= done.prompt_cached_tokens < len(prompt)
        check_budget(engine)
        conversation = prompt + ids + user_turn(turn)
