"""The MTP-head trainer (``mtp-runner train-head``, ``drafting.training``) and its parts, on
small random targets.

The end-to-end tests run the real command in a subprocess (generation, training, sidecar) and
load its output through the runner's own head loader.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cache.kv import KVCache
from drafting.session import DraftSession
from drafting.training import chain, dataset, generate, nphead, prompts, train
from drafting.training.config import TrainingError
from drafting.training.nphead import NumpyHead
from drafting.training.sidecar import build_head
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.sampler import Sampler, SamplingParams
from runner.training_target import RunnerTarget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHAT = "chatml"  # the test tokenizer knows <|im_start|> / <|im_end|>


def write_prompt_set(directory) -> str:
    os.makedirs(directory, exist_ok=True)
    train_spec = {
        "category": "test",
        "templates": [
            {"id": "greet", "text": "hello {x}", "slots": {"x": ["fox", "dog", "robot"]}},
            {"id": "capital", "text": "the capital of {x}", "slots": {"x": ["France", "Italy"]}},
        ],
    }
    held_spec = {
        "category": "test held out",
        "heldout": True,
        "templates": [{"id": "code", "text": "def {x}", "slots": {"x": ["add", "print"]}}],
    }
    with open(os.path.join(directory, "templates_train.json"), "w") as f:
        json.dump(train_spec, f)
    with open(os.path.join(directory, "templates_held.json"), "w") as f:
        json.dump(held_spec, f)
    with open(os.path.join(directory, "handwritten.txt"), "w") as f:
        f.write("# comment\nOnce upon a time\nfor i in range(10):\\n    print(i)\n")
    return str(directory)


def train_command(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``mtp-runner train-head ARGV`` (its log and progress go to stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "runner", "train-head", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def run_script(*argv: str, timeout: int = 120) -> str:
    """A successful ``train-head`` run's stderr (the log)."""
    proc = train_command(*argv, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stderr


def trainer_args(target: str, prompt_dir: str, work: str, out: str, *extra: str) -> list[str]:
    return [
        target,
        "--out",
        out,
        "--work-dir",
        work,
        "--prompts-dir",
        prompt_dir,
        "--template",
        CHAT,
        "--max-new-tokens",
        "20",
        "--gen-batch",
        "4",
        "--draft-vocab",
        "48",
        "--batch",
        "256",
        "--warmup",
        "2",
        "--eval-every",
        "5",
        "--checkpoint-every",
        "5",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """One real training run of the script: (target, prompt dir, work dir, sidecar dir, log)."""
    base = tmp_path_factory.mktemp("trainer")
    prompt_dir = write_prompt_set(base / "prompts")
    work, out = str(base / "work"), str(base / "head")
    log = run_script(*trainer_args(tiny_checkpoint, prompt_dir, work, out, "--steps", "24"))
    return tiny_checkpoint, prompt_dir, work, out, log


# -- the end-to-end run -----------------------------------------------------------------------


def test_training_lowers_the_loss_and_records_the_run(trained):
    _, _, work, out, log = trained
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    rec = config["training"]
    assert rec["final_loss"] < 0.7 * rec["first_loss"], rec
    assert config["architecture"] == "mtp_head" and config["naming"] == "qwen3_next"
    assert config["draft_vocab_size"] == 48
    # 5 training prompts (2 templates + hand-written), the held-out template kept apart.
    assert rec["prompts"] == 7 and rec["templates"] == 3
    assert rec["heldout_templates"] == ["code"]
    seqs = dataset.load_sequences(work)
    heldout_ids = {s.prompt_index for s in seqs if s.heldout}
    assert heldout_ids and heldout_ids.isdisjoint({s.prompt_index for s in seqs if not s.heldout})
    # Answer pairs: two fewer pairs than fed tokens per sequence, counted from the prompt end.
    expected = sum(len(s.tokens) - s.prompt_len - 1 for s in seqs if not s.heldout)
    assert rec["pairs"] == expected
    assert "held-out agreement" in log


def test_sidecar_loads_through_the_runner_and_drafts_like_the_trained_head(trained):
    target, _, work, out, _ = trained
    loaded = load_model(target)
    head, description = load_draft_head(loaded, out)
    assert "draft vocab 48" in description
    names = set(mx.load(os.path.join(out, "mtp.safetensors")))
    assert {
        "mtp.fc.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.norm.weight",
        "mtp.draft_vocab",
    } <= names
    assert mx.load(os.path.join(out, "mtp.safetensors"))["mtp.fc.weight"].dtype == mx.float16

    seqs = [s for s in dataset.load_sequences(work) if s.heldout]
    vocab = np.array(head.config.draft_vocab)
    index = np.full(loaded.vocab_size, -1)
    index[vocab] = np.arange(len(vocab))
    batches = [train.collate([train.to_example(s, index)], with_unlabeled=True) for s in seqs]
    trained_agreement = train.agreement(head, batches)
    with open(os.path.join(out, "config.json")) as f:
        recorded = json.load(f)["training"]["heldout_acceptance"]
    assert abs(trained_agreement - recorded) < 0.05  # float16 storage may flip a near-tie
    fresh = build_head(RunnerTarget(target, tune=False), head.config.draft_vocab)
    assert trained_agreement > train.agreement(fresh, batches) + 0.2

    # Drafting with the loaded head as the runner does: tokens from the draft vocabulary.
    ev = chain.evaluate_chain(head, RunnerTarget(target), seqs, depth=3, sampling=None)
    assert abs(ev["conditional"][0] - trained_agreement) < 1e-6


@pytest.mark.parametrize("vocabulary", ["draft", "full"])
def test_chain_eval_counts_what_the_runners_draft_session_proposes(trained, vocabulary):
    target, _, work, out, _ = trained
    loaded = load_model(target)
    head, _ = load_draft_head(loaded, out)
    if vocabulary == "full":  # e.g. a published MTP head: drafts over the target's output
        head.set_draft_vocab(None)
    # Sampled answers have varied labels; compare greedy drafts against the target's argmax.
    seq = max(
        (s for s in dataset.load_sequences(work) if s.temperature > 0),
        key=lambda s: len(s.tokens) - s.prompt_len,
    )
    greedy = Sampler(SamplingParams(temperature=0.0), [], loaded.vocab_size, 4096)
    depth, hits, tries = 3, np.zeros(3), np.zeros(3)
    for t in range(seq.prompt_len - 1, len(seq.tokens) - 2):  # step 1 needs argmax[t + 1]
        session = DraftSession(head, KVCache(), loaded.model.unembed)
        session.committed(seq.tokens[: t + 1].tolist(), mx.array(seq.hiddens[: t + 1]), 0)
        drafts = np.array(session.propose(int(seq.tokens[t + 1]), depth, greedy, slot=t + 2).tokens)
        for j in range(depth):
            if t + j + 1 > len(seq.tokens) - 2:
                break
            tries[j] += 1
            hits[j] += drafts[j] == seq.argmax[t + j + 1]
            if drafts[j] != seq.argmax[t + j + 1]:
                break
    assert tries[0] >= 10 and 0 < hits[0]
    ev = chain.evaluate_chain(head, RunnerTarget(target), [seq], depth, sampling=None)
    assert ev["positions"] == tries[0]
    expected = [h / n if n else None for h, n in zip(hits, tries, strict=True)]
    assert ev["conditional"] == pytest.approx(expected)


def test_resume_continues_where_training_stopped(trained, tmp_path):
    target, prompt_dir, work, _, _ = trained
    # Same data (cached generation is reused), training split over two invocations.
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_script(
        *trainer_args(target, prompt_dir, work, straight, "--steps", "10", "--stage", "train")
    )
    run_script(
        *trainer_args(
            target,
            prompt_dir,
            work,
            split,
            "--steps",
            "10",
            "--stop-after",
            "5",
            "--stage",
            "train",
        )
    )
    assert not os.path.exists(os.path.join(split, "config.json"))
    log = run_script(
        *trainer_args(
            target, prompt_dir, work, split, "--steps", "10", "--resume", "--stage", "train"
        )
    )
    assert "resumed at step 5/10" in log
    a = mx.load(os.path.join(straight, "mtp.safetensors"))
    b = mx.load(os.path.join(split, "mtp.safetensors"))
    for name in a:
        assert mx.array_equal(a[name], b[name]).item(), name


def test_training_can_continue_from_a_written_head(trained, tmp_path):
    target, prompt_dir, work, out, _ = trained
    more = str(tmp_path / "more")
    # The one-step NumPy trainer continuing a head the chain trained.
    log = run_script(
        *trainer_args(
            target,
            prompt_dir,
            work,
            more,
            "--steps",
            "4",
            "--init-head",
            out,
            "--stage",
            "train",
            "--chain-steps",
            "1",
        )
    )
    assert f"starting from the head in {out}" in log
    with open(os.path.join(out, "config.json")) as f:
        first = json.load(f)["training"]
    with open(os.path.join(more, "config.json")) as f:
        second = json.load(f)["training"]
    assert second["continued_from"]["steps"] == first["steps"] == 24
    assert second["train_minutes"] >= first["train_minutes"]
    start = [ln for ln in log.splitlines() if "step 0/4" in ln][0]
    assert float(start.split()[-1]) == pytest.approx(first["heldout_acceptance"], abs=0.05)
    a = mx.load(os.path.join(out, "mtp.safetensors"))["mtp.draft_vocab"]
    b = mx.load(os.path.join(more, "mtp.safetensors"))["mtp.draft_vocab"]
    assert mx.array_equal(a, b).item()


def test_generation_is_cached_and_a_changed_plan_is_refused(trained):
    target, prompt_dir, work, out, _ = trained
    proc = train_command(
        *trainer_args(
            target, prompt_dir, work, out, "--stage", "generate", "--max-new-tokens", "21"
        ),
        timeout=60,
    )
    # A TrainingError: exit status 1 and one line naming the cause, no traceback.
    assert proc.returncode == 1 and "another plan" in proc.stderr
    assert "Traceback" not in proc.stderr
    again = run_script(*trainer_args(target, prompt_dir, work, out, "--stage", "generate"))
    planned = len(dataset.read_plan(work)[0])
    assert f"in {planned} batches ({planned} cached)" in again
    assert "generate [" not in again  # nothing regenerated


def test_adding_prompts_extends_the_cached_plan(trained, tmp_path):
    target, prompt_dir, work, out, _ = trained
    work2, prompts2 = str(tmp_path / "work"), str(tmp_path / "prompts")
    shutil.copytree(work, work2)
    shutil.copytree(prompt_dir, prompts2)
    template = {"id": "verbs", "text": "to {x} or not", "slots": {"x": ["be", "run", "fly"]}}
    spec = {"category": "new", "templates": [template]}
    with open(os.path.join(prompts2, "templates_added.json"), "w") as f:
        json.dump(spec, f)
    before = dataset.read_plan(work2)[0]
    log = run_script(*trainer_args(target, prompts2, work2, out, "--stage", "generate"))
    after = dataset.read_plan(work2)[0]
    assert after[: len(before)] == [
        [dataclasses.replace(j, prompt_index=a.prompt_index) for j, a in zip(b, nb, strict=True)]
        for b, nb in zip(before, after, strict=False)
    ]  # the cached batches keep their jobs
    added = [j for b in after[len(before) :] for j in b]
    assert len(added) == 6 and not any(j.heldout for j in added)  # 3 prompts x (greedy, T>0)
    assert f"({len(before)} cached)" in log
    seqs = dataset.load_sequences(work2)
    texts = {p.index: p.text for p in prompts.load_prompt_set(prompts2)}
    assert sum(texts[s.prompt_index].startswith("to ") for s in seqs) == 6


# -- parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
    ],
)
def test_trainer_target_features_equal_the_runners_forward(checkpoint_factory, model_type, extra):
    """The trainer's target (the runner's model, laid out and compiled for serving speed) over
    a left-padded batch, prefill then cached steps, gives each row the hiddens the runner's
    plain forward gives that sequence alone."""
    check_target_features(checkpoint_factory(model_type, seed=5, **extra))


def check_target_features(path: str) -> None:
    plain = load_model(path).model
    target = RunnerTarget(path)
    rows = [[5, 17, 101, 33, 7, 250, 12, 9, 64, 3, 8, 200], [44, 9, 18, 71, 2, 90, 6, 31]]
    width = 8  # prompt columns: row 1's 8 tokens and row 0's first 4, left-padded
    prompts_ = [rows[0][:4], rows[1]]
    pads = np.array([width - len(p) for p in prompts_])
    grid = np.array([[0] * pads[b] + p for b, p in enumerate(prompts_)])
    cache = target.new_cache(2, 32)
    got = target.hidden(grid, cache, 0, generate.prefill_mask(pads, width))
    want = [np.array(plain.hidden(mx.array([r]), plain.make_caches()))[0] for r in rows]
    for b, p in enumerate(prompts_):
        assert np.abs(got[b, pads[b] :] - want[b][: len(p)]).max() < 1e-4
    for step in range(4):  # then one position at a time from the cache, row 0 continuing
        feed = np.array([[rows[0][4 + step]], [rows[1][step % 8]]])
        h = target.hidden(feed, cache, width + step, generate.step_mask(pads, width + step + 1))
        assert np.abs(h[0, 0] - want[0][4 + step]).max() < 1e-4
    assert np.abs(target.logits(got[1]) - np.array(plain.unembed(mx.array(want[1])))).max() < 1e-3


def test_trainer_target_features_of_moe_and_quantized_targets(exact_products):
    """qwen3_moe (sparse and dense layers) and a Q8-quantized llama through the same check
    (its products exact: the check compares padded batches with single rows at float32's
    tolerance, which int8 activations' rounding steps would exceed)."""
    for name in ("moe/qwen3_moe", "llama_q8"):
        check_target_features(os.path.join(ROOT, "tests", "fixtures", "reference", name))


def test_targets_the_trainer_cannot_drive_are_refused_by_name():
    """Left-padded batches cannot drive recurrent or sliding-window layers: refused at load,
    naming the family and the path."""
    for name in ("hybrid/qwen3_5_vl", "mistral_sliding"):
        path = os.path.join(ROOT, "tests", "fixtures", "reference", name)
        with pytest.raises(TrainingError, match="recurrent or sliding-window") as raised:
            RunnerTarget(path)
        assert path in str(raised.value)
    with pytest.raises(TrainingError, match="cannot load the target"):
        RunnerTarget(os.path.join(ROOT, "no-such-model"))


def test_left_padded_batch_generation_matches_single_sequences(tiny_checkpoint):
    loaded = load_model(tiny_checkpoint)
    tok = loaded.tokenizer
    texts = ["hello there", "the capital of France is", "a"]
    ids = [tok.encode(prompts.render(CHAT, t)) for t in texts]
    target = RunnerTarget(tiny_checkpoint)
    seqs = generate.generate_batch(
        target,
        ids,
        [0.0, 0.0, 0.0],
        prompt_ids=[0, 1, 2],
        max_new_tokens=12,
        eos_ids=set(tok.eos_ids),
    )
    assert len({len(i) for i in ids}) == 3  # really padded
    for s in seqs:
        # Teacher-forced MLX pass over the same tokens: hiddens, argmax and greedy tokens agree.
        h = loaded.model.hidden(mx.array(s.tokens[None, :-1]), loaded.model.make_caches())
        amax = np.array(mx.argmax(loaded.model.unembed(h), axis=-1))[0]
        p = s.prompt_len
        assert s.hiddens.shape == (len(s.tokens) - 1, loaded.model.args.hidden_size)
        assert np.abs(np.array(h[0]) - s.hiddens.astype(np.float32)).max() < 1e-2
        assert (s.argmax[p - 1 :] == amax[p - 1 :]).all()
        assert (s.tokens[p:] == amax[p - 1 :]).all()
        assert (s.argmax[: p - 1] == -1).all()


def _mlx_loss(head, batch, loss: str, reg: float) -> mx.array:
    value = train.loss_fn(head, batch, loss)
    if reg:
        hid = mx.array(batch.hiddens).astype(mx.float32)
        y = head(mx.array(batch.tokens), hid, train.WholeSequenceCache(), mask="causal")
        y = y.reshape(-1, y.shape[-1])[mx.array(batch.rows)]
        nxt = mx.array(batch.next_hiddens).astype(mx.float32)
        value = value + reg * mx.mean(mx.square(y - nxt))
    return value


@pytest.mark.parametrize(
    "model_type,extra,loss,reg",
    [
        ("llama", {}, "ce", 0.0),
        ("qwen2", {"tie_word_embeddings": False}, "kl", 0.0),
        ("qwen3", {}, "mix", 0.5),
    ],
)
def test_numpy_head_gradients_match_mlx_autograd(checkpoint_factory, model_type, extra, loss, reg):
    target = RunnerTarget(checkpoint_factory(model_type, seed=7, **extra), tune=False)
    mx.random.seed(3)
    head = build_head(target, list(range(0, 300, 3)))  # a 100-token draft vocabulary
    trainer = NumpyHead(head, target)
    rng = np.random.default_rng(1)
    batch = train.Batch(
        tokens=rng.integers(0, 300, (2, 9)).astype(np.int32),
        hiddens=rng.normal(size=(2, 9, 64)).astype(np.float16),
        rows=np.array([2, 3, 5, 8, 11, 12, 17]),
        labels=np.array([4, -1, 50, 99, 0, 7, 7], dtype=np.int32),
        next_hiddens=rng.normal(size=(7, 64)).astype(np.float16),
        pairs=18,
    )
    ref_loss, ref_grads = nn.value_and_grad(head, lambda h: _mlx_loss(h, batch, loss, reg))(head)
    ref = dict(tree_flatten(ref_grads))
    logits, cache = trainer.forward(batch.tokens, batch.hiddens, batch.rows)
    nxt = batch.next_hiddens.astype(np.float32)
    value, dlogits = nphead.loss_and_grad(logits, batch.labels, nxt @ trainer.out_t, loss)
    dy = None
    if reg:
        mse, dy = nphead.hidden_regression(cache["y"], nxt)
        value, dy = value + reg * mse, reg * dy
    grads = trainer.named(trainer.backward(dlogits, cache, dy))
    assert value == pytest.approx(ref_loss.item(), rel=1e-4)
    assert set(grads) == set(ref)
    for name, g in grads.items():
        r = np.array(ref[name])
        assert np.abs(g - r).max() <= 1e-3 * np.abs(r).max() + 1e-6, name
    # And the weights go back under the head's own names unchanged.
    for name, value in trainer.to_head_weights():
        assert mx.allclose(value, dict(tree_flatten(head.parameters()))[name]).item(), name


def test_dropout_gradients_match_finite_differences(tiny_checkpoint):
    target = RunnerTarget(tiny_checkpoint, tune=False)
    mx.random.seed(4)
    trainer = NumpyHead(build_head(target, list(range(0, 300, 3))), target)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 300, (2, 7)).astype(np.int32)
    hiddens = rng.normal(size=(2, 7, 64)).astype(np.float16)
    rows, labels = np.array([1, 4, 6, 9, 13]), np.array([3, 8, 99, 0, 41], dtype=np.int32)

    def loss(with_grad: bool):
        # The same seed draws the same dropout masks on every call.
        logits, cache = trainer.forward(tokens, hiddens, rows, 0.3, np.random.default_rng(9))
        value, dlogits = nphead.loss_and_grad(logits, labels, None, "ce")
        return (value, trainer.backward(dlogits, cache)) if with_grad else value

    _, grads = loss(True)
    direction = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in grads.items()}
    expected = sum(float((grads[k] * direction[k]).sum()) for k in grads)
    base = {k: v.copy() for k, v in trainer.params.items()}
    eps, values = 1e-3, []
    for sign in (1, -1):
        trainer.params = {k: base[k] + sign * eps * direction[k] for k in base}
        values.append(loss(False))
    trainer.params = base
    assert (values[0] - values[1]) / (2 * eps) == pytest.approx(expected, rel=0.03)
    # Without dropout the masks are gone: two calls agree exactly.
    a, _ = trainer.forward(tokens, hiddens, rows)
    b, _ = trainer.forward(tokens, hiddens, rows)
    assert np.array_equal(a, b)


def test_processed_distribution_matches_the_runner_sampler():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32) * 3
    ids, probs = generate.processed_topk(logits, 0.7, 40, 0.9)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repeat_penalty=1.0)
    dense = np.array(Sampler(params, [], 300, 1024).distributions(mx.array(logits)))
    mine = np.zeros_like(dense)
    np.put_along_axis(mine, ids, probs, axis=-1)
    assert np.abs(mine - dense).max() < 1e-5


def test_prompt_set_is_large_diverse_and_keeps_heldout_templates_apart():
    items = prompts.load_prompt_set()
    train_set, held = prompts.split_prompts(items)
    assert len(train_set) >= 1500
    train_templates = {p.template for p in train_set}
    assert len(train_templates - {"handwritten"}) >= 60
    assert len([p for p in train_set if p.template == "handwritten"]) >= 100
    held_templates = {p.template for p in held}
    assert len(held_templates) >= 8 and not held_templates & train_templates
    assert len({p.text for p in items}) == len(items)  # no duplicates
    assert [p.text for p in prompts.load_prompt_set()] == [p.text for p in items]  # stable
    wrapped = prompts.render("chatml-smollm", "Hi")
    assert wrapped.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert wrapped.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_pairs_are_labelled_with_the_targets_choice_two_tokens_ahead():
    # tokens t0..t5, prompt of 3; argmax[i] is the target's choice after feeding t_i.
    seq = dataset.Sequence(
        prompt_index=0,
        temperature=0.0,
        prompt_len=3,
        tokens=np.array([10, 11, 12, 13, 14, 15]),
        hiddens=np.arange(5 * 2, dtype=np.float16).reshape(5, 2),
        argmax=np.array([-1, -1, 13, 14, 99]),
        heldout=False,
    )
    index = np.full(128, -1)
    index[[13, 14]] = [0, 1]
    ex = train.to_example(seq, index)
    # pair i = (t_{i+1}, h_i), label = argmax after t_{i+1}; loss from the last prompt pair on.
    assert ex.tokens.tolist() == [11, 12, 13, 14]
    assert ex.hiddens[:, 0].tolist() == [0, 2, 4, 6]
    assert ex.next_hiddens[:, 0].tolist() == [2, 4, 6, 8]
    assert ex.labels.tolist() == [-1, 0, 1, -1]  # 99 lies outside the draft vocabulary
    assert ex.first_loss == 2


# -- a mixture-of-experts target --------------------------------------------------------------

MOE_TARGET = os.path.join(ROOT, "tests", "fixtures", "reference", "moe", "qwen3_moe")


def test_a_head_trained_for_a_moe_target_loads_and_drafts_losslessly(tmp_path):
    """The whole script on qwen3_moe: a dense head started from the last layer (its MLP from
    the first expert) learns, loads through the runner's head loader and drafts; speculative
    greedy output equals plain greedy output."""
    from protocol.requests import Completion, Options
    from runner.engine import Engine, EngineOptions

    prompt_dir = write_prompt_set(tmp_path / "prompts")
    out = str(tmp_path / "head")
    run_script(*trainer_args(MOE_TARGET, prompt_dir, str(tmp_path / "work"), out, "--steps", "24"))
    with open(os.path.join(out, "config.json")) as f:
        rec = json.load(f)["training"]
    assert rec["final_loss"] < 0.7 * rec["first_loss"], rec
    loaded = load_model(MOE_TARGET)
    head, _ = load_draft_head(loaded, out)
    assert type(head.layers[0].mlp).__name__ == "MLP"
    assert head.layers[0].mlp.gate_proj.weight.shape[0] == 16  # the experts' width

    def greedy(engine: Engine, tokens: list[int]):
        frames: list = []
        options = Options(num_predict=30, temperature=0, repeat_penalty=1.0)
        engine.run(
            engine.prepare(Completion(id="r", tokens=tokens, options=options)),
            frames.append,
            lambda: False,
        )
        ids = [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]
        return ids, frames[-1]

    plain = Engine(EngineOptions(model_path=MOE_TARGET, use_draft=False))
    spec = Engine(EngineOptions(model_path=MOE_TARGET, draft_path=out, draft_depth=2))
    accepted = 0
    for text in ("hello fox", "the capital of Italy"):
        tokens = loaded.tokenizer.encode(prompts.render(CHAT, text))
        want, _ = greedy(plain, tokens)
        got, done = greedy(spec, tokens)
        assert got == want
        accepted += done.speculation.accepted
    assert accepted > 0


# -- the prompt's template ---------------------------------------------------------------------


def test_prompts_take_the_targets_own_template_or_name_the_flag(tiny_checkpoint, tmp_path):
    from drafting.training.run import prompt_ids

    plain = RunnerTarget(tiny_checkpoint, tune=False)
    with pytest.raises(TrainingError, match="no chat template: pass --template"):
        prompt_ids("model", "hello fox", plain)
    assert prompt_ids(CHAT, "hello fox", plain) == plain.tokenizer.encode(
        prompts.render(CHAT, "hello fox")
    )
    templated = tmp_path / "templated"
    shutil.copytree(tiny_checkpoint, templated)
    config_path = templated / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    config["chat_template"] += "<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\n' }}"
    config_path.write_text(json.dumps(config))
    target = RunnerTarget(str(templated), tune=False)
    want = target.tokenizer.encode(prompts.render(CHAT, "hello fox"), add_bos=False)
    assert prompt_ids("model", "hello fox", target) == want


@pytest.mark.default_model
def test_the_default_models_own_template_is_the_shipped_heads(default_model):
    """The head was trained with the chatml-smollm template; the model's own renders the same
    ids, so the default changed nothing for it (and cached plans stay valid)."""
    from drafting.training.run import prompt_ids

    target = RunnerTarget(default_model, tune=False)
    for text in ("Why is the sky blue?", "def add(a, b):"):
        assert prompt_ids("model", text, target) == prompt_ids("chatml-smollm", text, target)


def test_a_time_budget_sizes_the_prompts_and_cuts_the_steps(trained, tmp_path):
    """``--minutes``: the held-out answers time the target, the training prompts are what the
    generation share allows (at least one), and the steps stop where the budget ends; the
    head's record keeps the budget. A rerun plans the same prompts from the work dir."""
    target, prompt_dir, _, _, _ = trained
    work, out = str(tmp_path / "work"), str(tmp_path / "head")
    # Answers four times the usual length, so that the tiny target's generation cannot fit
    # the whole prompt set into the budget's share on a fast machine either.
    longer = ("--max-new-tokens", "80")
    args = trainer_args(
        target, prompt_dir, work, out, "--minutes", "0.004", "--steps", "100000", *longer
    )
    log = run_script(*args)
    assert "[gen] budget 0.004 min" in log
    assert "the time budget fits" in log
    with open(os.path.join(out, "config.json")) as f:
        rec = json.load(f)["training"]
    with open(os.path.join(work, "budget.json")) as f:
        budget = json.load(f)
    assert rec["minutes_budget"] == 0.004 and 1 <= rec["prompts"] == budget["prompts"] < 7
    assert rec["steps"] < 100000
    again = run_script(
        *trainer_args(
            target, prompt_dir, work, out, "--minutes", "0.004", "--stage", "generate", *longer
        )
    )
    assert "(0 cached)" not in again and "budget 0.004" not in again
