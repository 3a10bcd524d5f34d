"""Training-time test (``drafting.training.chain_train``) and fused-feature heads: what the
chain trains on is what the runner's draft cache holds, and a fused head's rows reach it
through every forward of the runner."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cache.kv import KVCache
from drafting.training import chain_train, dataset, generate, nphead, train
from drafting.training.nphead import NumpyHead
from drafting.training.sidecar import build_head, write_head
from protocol.errors import DraftHeadError
from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.training_target import RunnerTarget
from tests.test_engine import CHAT, GREEDY, complete
from tests.test_trainer import ROOT, run_script, train_command, trainer_args, write_prompt_set

STEPS = 3


def _example(rng, n: int, width: int, dim: int, vocab: int, oov: bool = True) -> train.Example:
    low = -1 if oov else 0
    return train.Example(
        tokens=rng.integers(0, vocab, n).astype(np.int32),
        hiddens=rng.normal(size=(n, width)).astype(np.float16),
        next_hiddens=rng.normal(size=(n, dim)).astype(np.float16),
        labels=rng.integers(low, vocab, n).astype(np.int32),
        first_loss=3,
    )


def _fused_head(target: RunnerTarget, layers: list[int], seed: int = 0):
    mx.random.seed(seed)
    head = build_head(target, list(range(60)), layers)
    if layers:  # a fusion that reads every stream, not the pass-through it starts as
        head.fuse.proj.weight = 0.1 * mx.random.normal(head.fuse.proj.weight.shape)
    return head


@pytest.mark.parametrize("layers", [[], [1]])
def test_each_chain_step_computes_what_the_draft_cache_computes(tiny_checkpoint, layers):
    """Chain step j at pair i equals the runner's chain at frontier i: the committed pairs
    0..i through a KV cache, then the head fed its own output j - 1 times (sequences longer
    than the fast-SiLU threshold, which training must not take)."""
    target = RunnerTarget(tiny_checkpoint, tune=False)
    head = _fused_head(target, layers)
    dim = target.model.args.hidden_size
    rng = np.random.default_rng(0)
    ex = _example(rng, 48, head.feature_width, dim, 60)
    batch = chain_train.to_device(chain_train.collate_chain([ex], STEPS), STEPS)
    outs = [y for _, y in chain_train.chain_outputs(head, batch, STEPS)]
    worst = 0.0
    for i in range(0, 46, 5):
        cache = KVCache()
        rows = mx.array(ex.hiddens[None, : i + 1]).astype(mx.float32)
        cur = head(mx.array(ex.tokens[None, : i + 1]), rows, cache)[:, -1:]
        worst = max(worst, float(mx.abs(cur[0, 0] - outs[0][0, i]).max()))
        for j in range(1, STEPS):
            cur = head(mx.array(ex.tokens[None, i + j : i + j + 1]), cur, cache)
            worst = max(worst, float(mx.abs(cur[0, 0] - outs[j][0, i]).max()))
    assert worst < 1e-4


def test_one_chain_step_is_the_numpy_trainers_loss(tiny_checkpoint):
    """With one step the chain's loss (CE + KL + the hidden regression) is the NumPy step's,
    so both trainers optimise the same thing where both apply."""
    target = RunnerTarget(tiny_checkpoint, tune=False)
    head = build_head(target, list(range(60)))
    dim = target.model.args.hidden_size
    rng = np.random.default_rng(1)
    examples = [_example(rng, n, dim, dim, 60, oov=False) for n in (40, 33)]
    opts = chain_train.ChainOptions(steps=1, loss="mix", hidden_loss=0.5)
    chain_value = chain_train.chain_loss(
        head, chain_train.to_device(chain_train.collate_chain(examples, 1), 1), opts
    ).item()
    batch = train.collate(examples, with_unlabeled=True)
    numpy_head = NumpyHead(head, target)
    logits, cache = numpy_head.forward(batch.tokens, batch.hiddens, batch.rows)
    nxt = batch.next_hiddens.astype(np.float32)
    value, _ = nphead.loss_and_grad(logits, batch.labels, nxt @ numpy_head.out_t, "mix")
    value += 0.5 * nphead.hidden_regression(cache["y"], nxt)[0]
    assert chain_value == pytest.approx(value, rel=1e-4)


def test_chain_labels_skip_prompts_padding_and_out_of_vocabulary_rows():
    rng = np.random.default_rng(2)
    ex = _example(rng, 10, 4, 4, 9)
    ex.labels[:] = np.arange(10)
    ex.labels[6] = -1  # outside the draft vocabulary
    dev = chain_train.to_device(chain_train.collate_chain([ex], STEPS), STEPS)
    for j in range(STEPS):
        # Step j's row i is labelled by pair i + j; rows before first_loss are context.
        want = [i for i in range(3, 10 - j) if i + j != 6]
        assert np.array(dev["loss_rows"][j]).tolist() == want
        assert np.array(dev["labels"][j]).tolist() == [i + j for i in want]
        assert dev["answer_rows"][j] == len(range(3, 10 - j))  # the OOV row is a miss


def test_model_rows_carry_a_fused_heads_streams(tiny_checkpoint):
    """With a fused head's layers set, every forward returns the streams ahead of the final
    hidden; the logits read the hidden, and the shared rows of several sequences carry the
    same streams as a lone forward."""
    model = load_model(tiny_checkpoint).model
    tokens = mx.array([[5, 9, 33, 2, 17]])
    h, streams = model.hidden_features(tokens, model.make_caches(), (1,))
    model.use_draft_features((1,))
    try:
        wide = model.hidden(tokens, model.make_caches())
        assert mx.array_equal(wide, mx.concatenate([streams, h], axis=-1)).item()
        assert mx.allclose(model.unembed(wide), model.unembed(h)).item()
        caches = [model.make_caches(), model.make_caches()]
        for c, prefix in zip(caches, ([5, 9, 33, 2], [7, 7]), strict=True):
            model.hidden(mx.array([prefix]), c)
        rows = model.hidden_rows(mx.array([17, 4]), caches)
        alone = model.make_caches()
        model.hidden(mx.array([[7, 7]]), alone)
        assert rows.shape == (2, wide.shape[-1])
        assert mx.allclose(rows[0], wide[0, -1], atol=1e-5).item()
        assert mx.allclose(rows[1], model.hidden(mx.array([[4]]), alone)[0, 0], atol=1e-5).item()
    finally:
        model.use_draft_features(())


def _write_fused(tiny_checkpoint, out: str) -> None:
    target = RunnerTarget(tiny_checkpoint, tune=False)
    write_head(out, _fused_head(target, [1], seed=3), target, {"note": "test"})


def test_a_fused_head_round_trips_and_serves_losslessly(tiny_checkpoint, tmp_path):
    out = str(tmp_path / "fused")
    _write_fused(tiny_checkpoint, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["feature_layers"] == [1]
    head, description = load_draft_head(load_model(tiny_checkpoint), out)
    assert head.config.feature_layers == [1] and "after layers [1]" in description
    saved = mx.load(os.path.join(out, "mtp.safetensors"))
    assert {"mtp.fuse.proj.weight", "mtp.fuse.norms.1.weight"} <= set(saved)

    def run(**options):
        engine = Engine(EngineOptions(model_path=tiny_checkpoint, **options))
        prompt = CHAT.format("the quick brown fox jumps over the lazy dog")
        ids, _, done, _ = complete(engine, prompt, num_predict=40, **GREEDY)
        return ids, done, engine

    plain, _, _ = run(use_draft=False)
    drafted, done, engine = run(draft_path=out, draft_depth=2)
    assert drafted == plain
    assert engine.model.draft_features == (1,)
    assert done.speculation.drafted > 0 and done.speculation.rounds > 0


def test_a_fused_head_is_refused_where_the_forward_lacks_its_streams(
    tiny_checkpoint, tmp_path, monkeypatch
):
    out = str(tmp_path / "fused")
    _write_fused(tiny_checkpoint, out)
    loaded = load_model(tiny_checkpoint)
    monkeypatch.setattr(type(loaded.model), "serves_draft_features", False)
    with pytest.raises(DraftHeadError, match=r"fuses the streams after layers \[1\]"):
        load_draft_head(loaded, out)


def test_train_head_trains_a_fused_head_by_training_time_test(tiny_checkpoint, tmp_path):
    """The command end to end with --fuse and --chain-steps: the loss falls, the record says
    how it was trained, and the sidecar loads with its fusion trained away from the
    pass-through it started as."""
    prompt_dir = write_prompt_set(tmp_path / "prompts")
    out = str(tmp_path / "head")
    log = run_script(
        *trainer_args(
            tiny_checkpoint,
            prompt_dir,
            str(tmp_path / "work"),
            out,
            "--steps",
            "24",
            "--chain-steps",
            "2",
            "--fuse",
            "--feature-layers",
            "1",
            "--minutes",
            "0",
        ),
        timeout=300,
    )
    assert " chain " in log
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    rec = config["training"]
    assert rec["final_loss"] < 0.7 * rec["first_loss"], rec
    assert rec["chain_steps"] == 2 and rec["feature_layers"] == [1]
    head, _ = load_draft_head(load_model(tiny_checkpoint), out)
    weights = dict(tree_flatten(head.parameters()))
    streams_block = np.array(weights["fuse.proj.weight"])[:, : head.config.hidden_size]
    assert np.abs(streams_block).max() > 1e-3  # the low stream is read now
    # Continuing it without its streams is refused, naming them.
    proc = train_command(
        *trainer_args(
            tiny_checkpoint,
            prompt_dir,
            str(tmp_path / "work"),
            str(tmp_path / "more"),
            "--steps",
            "2",
            "--stage",
            "train",
            "--init-head",
            out,
            "--minutes",
            "0",
        )
    )
    assert proc.returncode == 1 and "fuses the streams after layers [1]" in proc.stderr


def test_a_head_that_cannot_be_loaded_is_named_without_a_traceback(tiny_checkpoint, tmp_path):
    """eval-head and --init-head on a directory that holds no head: exit status 1 and one
    line naming it."""
    missing = str(tmp_path / "no-head")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for argv in (
        ["eval-head", tiny_checkpoint, "--head", missing, "--work-dir", str(tmp_path / "e")],
        [
            "train-head",
            tiny_checkpoint,
            "--out",
            str(tmp_path / "o"),
            "--work-dir",
            str(tmp_path / "w"),
            "--init-head",
            missing,
            "--template",
            "chatml",
            "--minutes",
            "0",
            "--max-prompts",
            "1",
            "--max-heldout",
            "1",
            "--max-new-tokens",
            "4",
        ],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "runner", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=ROOT,
        )
        assert proc.returncode == 1, proc.stderr
        assert f"cannot load the head {missing}" in proc.stderr
        assert "Traceback" not in proc.stderr


class _FailingTarget:
    """A target whose forward fails once ``after`` forwards have run (a killed generation)."""

    def __init__(self, target: RunnerTarget, after: int) -> None:
        self._target, self._left = target, after

    def __getattr__(self, name):
        return getattr(self._target, name)

    def hidden_features(self, *args):
        if self._left == 0:
            raise KeyboardInterrupt
        self._left -= 1
        return self._target.hidden_features(*args)


def test_an_interrupted_generation_keeps_its_batches_and_their_time(tiny_checkpoint, tmp_path):
    target = RunnerTarget(tiny_checkpoint)
    tok = target.tokenizer
    jobs = [dataset.Job(i, 0.0, tok.encode(f"prompt number {i}"), False) for i in range(4)]
    settings = dataset.GenSettings(target="t", max_new_tokens=3, batch_size=2, top_k=0, seed=0)
    work = str(tmp_path / "work")
    dataset.prepare_plan(work, jobs, settings)
    with pytest.raises(KeyboardInterrupt):
        generate.run_generation(work, _FailingTarget(target, after=4))  # batch 0: 3 forwards
    assert os.path.exists(dataset.batch_path(work, 0))
    assert not os.path.exists(dataset.batch_path(work, 1))
    with open(os.path.join(work, "gen_stats.json")) as f:
        first = json.load(f)["seconds"]
    assert first > 0
    generate.run_generation(work, target)  # the rerun makes only what is missing
    with open(os.path.join(work, "gen_stats.json")) as f:
        assert json.load(f)["seconds"] > first
    assert len(dataset.load_sequences(work)) == 4


def test_left_padded_generation_records_the_streams_a_lone_sequence_has(tiny_checkpoint):
    """The streams recorded in a left-padded batch equal a teacher-forced forward of each
    sequence alone (the fused head trains on what the runner's forward gives it)."""
    loaded = load_model(tiny_checkpoint)
    tok = loaded.tokenizer
    ids = [tok.encode(t) for t in ("hello there", "the capital of France is", "a")]
    seqs = generate.generate_batch(
        RunnerTarget(tiny_checkpoint),
        ids,
        [0.0, 0.0, 0.0],
        prompt_ids=[0, 1, 2],
        max_new_tokens=10,
        eos_ids=set(tok.eos_ids),
        feature_layers=(1,),
    )
    for s in seqs:
        h, streams = loaded.model.hidden_features(
            mx.array(s.tokens[None, :-1]), loaded.model.make_caches(), (1,)
        )
        assert s.features.shape == (len(s.tokens) - 1, loaded.model.args.hidden_size)
        assert np.abs(np.array(streams[0]) - s.features.astype(np.float32)).max() < 1e-2
        assert np.abs(np.array(h[0]) - s.hiddens.astype(np.float32)).max() < 1e-2


def test_a_fused_head_serves_shared_forwards_as_alone(tiny_checkpoint, tmp_path, caplog):
    """Several streams decoding in shared forwards (``hidden_rows``, wide rows) while the
    later prompts prefill layer by layer between them, with a fused head: each gives its
    tokens alone, no draft session drops its head (rows of the wrong width would), and a
    stream left on its own speculates again from the rows the shared forwards handed it."""
    from tests.test_batch import alone, together

    out = str(tmp_path / "fused")
    _write_fused(tiny_checkpoint, out)
    # A fixed depth: the controller would park a random head's speculation.
    engine = Engine(
        EngineOptions(model_path=tiny_checkpoint, draft_path=out, parallel=3, draft_depth=2)
    )
    reqs = [
        Completion(
            id=f"r{i}",
            tokens=[5 + i, 17] + [(7 * j + i) % 250 for j in range(40 * i)],
            options=Options(temperature=0, num_predict=8 + 6 * i),
        )
        for i in range(3)
    ]
    # Together first, on an empty prefix cache: the later prompts prefill between forwards.
    outs, scheduler = together(engine, reqs)
    assert not [r for r in caplog.records if "draft head failed" in r.getMessage()]
    expected = {r.id: alone(engine, r).ids for r in reqs}
    assert scheduler.shared_steps > 0
    for r in reqs:
        assert outs[r.id].ids == expected[r.id]
    assert outs["r2"].done.speculation.rounds > 0  # the longest ends alone, speculating


def test_resuming_with_other_options_names_them_before_loading(tiny_checkpoint, tmp_path):
    """A checkpoint of the chain trainer resumed with the one-step trainer (whose parameters
    have other names): refused with the differing options named, no traceback."""
    prompt_dir = write_prompt_set(tmp_path / "prompts")
    work, out = str(tmp_path / "work"), str(tmp_path / "head")
    base = trainer_args(tiny_checkpoint, prompt_dir, work, out, "--steps", "6", "--minutes", "0")
    run_script(*base, "--stop-after", "3")
    proc = train_command(*base, "--resume", "--chain-steps", "1", "--stage", "train")
    assert proc.returncode == 1, proc.stderr
    assert "other training options (chain_steps); drop --resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    log = run_script(*base, "--resume", "--stage", "train")
    assert "resumed at step 3/6" in log


def test_generation_adds_prompts_while_its_share_of_the_budget_has_time(tiny_checkpoint, tmp_path):
    """The held-out timing (one small batch) can undersell the training batches: once the
    planned batches ran, prompts are added at the rate they ran while the generation share
    has a batch's time left, the batches made stay, and the count is recorded for reruns.
    With the share spent, nothing is added."""
    from drafting.training.config import TrainConfig
    from drafting.training.run import generate as generate_answers

    target = RunnerTarget(tiny_checkpoint, tune=False)
    prompt_dir = write_prompt_set(tmp_path / "prompts")
    work = str(tmp_path / "work")
    cfg = TrainConfig(
        target=tiny_checkpoint,
        out=str(tmp_path / "head"),
        work_dir=work,
        prompts_dir=prompt_dir,
        template="chatml",
        max_new_tokens=6,
        gen_batch=2,
        minutes=30.0,
        temperatures=(0.0, 0.7),
    )
    os.makedirs(work)
    with open(os.path.join(work, "budget.json"), "w") as f:  # as if the timing said 1
        json.dump({"minutes": 30.0, "answers_per_second": 0.001, "prompts": 1}, f)
    generate_answers(cfg, target)
    with open(os.path.join(work, "budget.json")) as f:
        budget = json.load(f)
    batches, _ = dataset.read_plan(work)
    train_jobs = [j for b in batches for j in b if not j.heldout]
    assert budget["prompts"] == 7 and budget["topped_up_at"] > 0  # the whole training set
    assert len(train_jobs) == 7 * 2 and len({j.prompt_index for j in train_jobs}) == 7
    assert len(dataset.load_sequences(work)) == len(train_jobs) + 2  # every batch generated

    spent = str(tmp_path / "spent")
    os.makedirs(spent)
    with open(os.path.join(spent, "budget.json"), "w") as f:
        json.dump({"minutes": 30.0, "answers_per_second": 0.001, "prompts": 1}, f)
    dataset.add_generation_seconds(spent, 0.6 * 30 * 60)  # the share is gone
    generate_answers(dataclasses.replace(cfg, work_dir=spent), target)
    with open(os.path.join(spent, "budget.json")) as f:
        assert json.load(f)["prompts"] == 1
    assert sum(not j.heldout for b in dataset.read_plan(spent)[0] for j in b) == 2
