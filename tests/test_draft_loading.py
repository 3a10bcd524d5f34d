"""Loading MTP heads (three namings, sidecars, discovery, errors) and driving a real head's
draft session next to a real target: offsets level, committed pairs from target hiddens."""

from __future__ import annotations

import dataclasses
import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cache.kv import KVCache
from drafting.load import scheme_name, write_sidecar
from drafting.session import DraftSession
from protocol.errors import DraftHeadError
from runner import default_model, device
from runner.heads import load_draft_head, sidecar_candidates
from runner.loader import load_model
from runner.sampler import Sampler, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.test_head import random_head

LAYERS = 2  # the tiny target's depth: DeepSeek names its head layer model.layers.2
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 64, 12, 8]


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    """The tiny target (unpacked, for reading weights) and a random head for it."""
    loaded = load_model(tiny_checkpoint)
    return loaded, random_head(loaded, seed=7)


def head_tensors(head, naming: str) -> dict[str, mx.array]:
    """The head's parameters spelled in ``naming``; MiMo's fc takes (hidden, embedding)."""
    params = dict(tree_flatten(head.parameters()))
    if naming == "mimo":
        w, d = params["fc.weight"], params["fc.weight"].shape[0]
        params["fc.weight"] = mx.concatenate([w[:, d:], w[:, :d]], axis=1)
    return {scheme_name(naming, k, LAYERS): v for k, v in params.items()}


def checkpoint_with(path, tensors: dict[str, mx.array]) -> str:
    """The tiny target (same seed as ``tiny_checkpoint``) plus extra tensors in a shard."""
    write_checkpoint(path, "llama", seed=0)
    mx.save_safetensors(os.path.join(path, "extra.safetensors"), tensors)
    return os.fspath(path)


def target_info(loaded) -> dict:
    args = loaded.model.args
    return {
        "model_type": args.model_type,
        "hidden_size": args.hidden_size,
        "vocab_size": args.vocab_size,
        "num_hidden_layers": args.num_hidden_layers,
    }


def sidecar(path, head, loaded, **kwargs) -> str:
    return write_sidecar(
        os.fspath(path),
        head,
        naming=kwargs.pop("naming", "qwen3_next"),
        target=target_info(loaded),
        **kwargs,
    )


def prefill_and_propose(loaded, head, k: int = 4, seed: int = 3):
    """Prefill PROMPT, settle, propose k drafts with a seeded sampling Sampler."""
    model = loaded.model
    caches, cache = model.make_caches(), KVCache()
    ds = DraftSession(head, cache, model.unembed)
    logits, hidden = model.forward(mx.array([PROMPT]), caches)
    ds.committed(PROMPT, hidden, 0)
    current = int(mx.argmax(logits[0, -1]).item())
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0, seed=seed)
    sampler = Sampler(params, PROMPT, model.args.vocab_size, loaded.context_length)
    proposal = ds.propose(current, k, sampler, slot=len(PROMPT) + 1)
    mx.eval(proposal.tokens)
    return proposal, ds, cache, caches


def head_outputs(loaded, head) -> np.ndarray:
    """The head's normed outputs for fixed random tokens and target hiddens."""
    tokens = mx.array([[3, 99, 250, 7]])
    hidden = mx.random.normal((1, 4, loaded.model.args.hidden_size), key=mx.random.key(5))
    return np.array(head(tokens, hidden, KVCache()))


# -- the three namings and sidecars ---------------------------------------------------------


def test_every_naming_and_a_sidecar_load_the_same_head(base, tmp_path):
    loaded, head = base
    results = {}
    for naming in ("qwen3_next", "deepseek", "mimo"):
        ckpt = checkpoint_with(tmp_path / naming, head_tensors(head, naming))
        target = load_model(ckpt)
        got, why = load_draft_head(target)
        assert got is not None and f"({naming} naming)" in why and "inline" in why
        assert got.config.hidden_first == (naming == "mimo")
        results[naming] = (prefill_and_propose(target, got)[0], head_outputs(target, got))
    side = sidecar(tmp_path / "side", head, loaded, naming="deepseek")
    got, why = load_draft_head(load_model(loaded.path), side)
    assert got is not None and side in why
    target = load_model(loaded.path)
    results["sidecar"] = (prefill_and_propose(target, got)[0], head_outputs(target, got))

    want, want_out = results.pop("qwen3_next")
    assert len(set(want.tokens.tolist())) > 1  # sampled over dense probabilities
    for name, (proposal, out) in results.items():
        assert proposal.tokens.tolist() == want.tokens.tolist(), name
        np.testing.assert_allclose(out, want_out, atol=1e-5)


def test_loaded_head_equals_the_unpacked_module(base, tmp_path):
    # Device tuning packs the head like the target (fc included); outputs must not change.
    loaded, head = base
    target = load_model(loaded.path)
    got, _ = load_draft_head(target, sidecar(tmp_path / "s", head, loaded))
    device.tune(target.model, got, compile=False)
    assert got.fc.get("_wt") is not None and got.layers[0].mlp.up_proj.get("_wt") is not None
    tokens = mx.array([[3, 99, 250]])
    hidden = mx.random.normal((1, 3, loaded.model.args.hidden_size))
    np.testing.assert_allclose(
        np.array(got(tokens, hidden, KVCache())),
        np.array(head(tokens, hidden, KVCache())),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_sidecar_is_cast_to_the_target_dtype(base, tmp_path, dtype):
    loaded, head = base
    path = sidecar(tmp_path / "half", head, loaded, dtype=dtype)
    assert mx.load(os.path.join(path, "mtp.safetensors"))["mtp.fc.weight"].dtype == dtype
    got, _ = load_draft_head(load_model(loaded.path), path)
    params = dict(tree_flatten(got.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float32}
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-3
    np.testing.assert_allclose(
        np.array(got.norm.weight), np.array(head.norm.weight), atol=tol, rtol=tol
    )


def test_zero_centred_norms_are_shifted_when_the_config_says_so(base, tmp_path):
    loaded, head = base
    path = sidecar(tmp_path / "shift", head, loaded, norm_shift=True)
    stored = mx.load(os.path.join(path, "mtp.safetensors"))
    assert abs(float(stored["mtp.pre_fc_norm_hidden.weight"].mean().item())) < 0.2
    got, _ = load_draft_head(load_model(loaded.path), path)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        np.testing.assert_allclose(
            np.array(getattr(got, name).weight), np.array(getattr(head, name).weight), atol=1e-6
        )
    np.testing.assert_allclose(
        np.array(got.layers[0].input_layernorm.weight),
        np.array(head.layers[0].input_layernorm.weight),
        atol=1e-6,
    )


def test_sidecar_draft_vocabulary_limits_the_drafts(base, tmp_path):
    loaded, head = base
    vocab = [4, 9, 17, 33, 64, 128, 200, 250]
    head.set_draft_vocab(vocab)
    try:
        path = sidecar(tmp_path / "dv", head, loaded)
    finally:
        head.set_draft_vocab(None)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == len(vocab)
    target = load_model(loaded.path)
    got, why = load_draft_head(target, path)
    assert got.config.draft_vocab == vocab and "draft vocab 8" in why
    proposal = prefill_and_propose(target, got, k=6)[0]
    assert set(proposal.tokens.tolist()) <= set(vocab)
    outside = np.setdiff1d(np.arange(target.model.args.vocab_size), vocab)
    y = mx.random.normal((3, target.model.args.hidden_size), key=mx.random.key(2))
    logits = np.array(got.draft_logits(y, target.model.unembed))
    assert np.all(logits[:, outside] == -np.inf) and np.isfinite(logits[:, vocab]).all()


# -- discovery ------------------------------------------------------------------------------


def test_sidecar_next_to_the_model_is_found(base, tmp_path):
    loaded, head = base
    ckpt = checkpoint_with(tmp_path / "ckpt", {})
    target = load_model(ckpt)
    none, why = load_draft_head(target)
    assert none is None and os.path.join(ckpt, "mtp") in why
    sidecar(os.path.join(ckpt, "mtp"), head, loaded)
    got, why = load_draft_head(load_model(ckpt))
    assert got is not None and os.path.join(ckpt, "mtp") in why
    # --draft may also name the weights file itself.
    got, _ = load_draft_head(target, os.path.join(ckpt, "mtp", "mtp.safetensors"))
    assert got is not None


def test_gguf_and_default_model_sidecar_paths(base, tmp_path, monkeypatch):
    loaded, head = base
    gguf = dataclasses.replace(loaded, path=str(tmp_path / default_model.FILENAME))
    monkeypatch.setattr(default_model, "HEAD_DIR", str(tmp_path / "heads" / "absent"))
    assert sidecar_candidates(gguf) == [gguf.path + ".mtp", default_model.HEAD_DIR]
    none, why = load_draft_head(gguf)  # the shipped head is not there yet: no speculation
    assert none is None and "absent" in why
    monkeypatch.setattr(default_model, "HEAD_DIR", sidecar(tmp_path / "heads" / "d", head, loaded))
    got, why = load_draft_head(gguf)
    assert got is not None and default_model.HEAD_DIR in why


# -- errors ---------------------------------------------------------------------------------


def rewrite(path: str, *, tensors=None, config=None) -> None:
    if tensors is not None:
        mx.save_safetensors(os.path.join(path, "mtp.safetensors"), tensors)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


def sidecar_parts(path):
    with open(os.path.join(path, "config.json")) as f:
        return dict(mx.load(os.path.join(path, "mtp.safetensors"))), json.load(f)


def test_shape_mismatch_names_the_tensor_and_the_file(base, tmp_path):
    loaded, head = base
    path = sidecar(tmp_path / "bad", head, loaded)
    tensors, _ = sidecar_parts(path)
    d = loaded.model.args.hidden_size
    tensors["mtp.fc.weight"] = mx.zeros((d, 2 * d + 2))
    rewrite(path, tensors=tensors)
    with pytest.raises(DraftHeadError) as err:
        load_draft_head(load_model(loaded.path), path)
    assert err.value.tensor == "mtp.fc.weight"
    assert err.value.path == os.path.join(path, "mtp.safetensors")
    assert f"({d}, {2 * d + 2})" in str(err.value) and "mtp.safetensors" in str(err.value)


def test_missing_tensor_is_named(base, tmp_path):
    loaded, head = base
    path = sidecar(tmp_path / "missing", head, loaded)
    tensors, _ = sidecar_parts(path)
    del tensors["mtp.layers.0.mlp.up_proj.weight"]
    rewrite(path, tensors=tensors)
    with pytest.raises(DraftHeadError, match="missing") as err:
        load_draft_head(load_model(loaded.path), path)
    assert err.value.tensor == "mtp.layers.0.mlp.up_proj.weight"


def test_broken_inline_head_runs_without_speculation_and_says_why(base, tmp_path):
    loaded, head = base
    tensors = head_tensors(head, "deepseek")
    del tensors["model.layers.2.enorm.weight"]
    target = load_model(checkpoint_with(tmp_path / "broken", tensors))
    none, why = load_draft_head(target)
    assert none is None and "model.layers.2.enorm.weight" in why and "missing" in why


def test_unexpected_tensor_is_an_error(base, tmp_path):
    loaded, head = base
    path = sidecar(tmp_path / "extra", head, loaded)
    tensors, _ = sidecar_parts(path)
    tensors["mtp.layers.0.self_attn.o_proj.bias"] = mx.zeros((loaded.model.args.hidden_size,))
    rewrite(path, tensors=tensors)
    with pytest.raises(DraftHeadError) as err:
        load_draft_head(load_model(loaded.path), path)
    assert err.value.tensor == "mtp.layers.0.self_attn.o_proj.bias"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"naming": "medusa"}, "unknown MTP head naming 'medusa'"),
        ({"architecture": "llama"}, "not an MTP head sidecar"),
        ({"target": {"hidden_size": 128}}, "hidden_size 128"),
        ({"target": {"num_hidden_layers": 30}}, "num_hidden_layers 30"),
        ({"hidden_first": "yes"}, "'hidden_first' must be true or false"),
        ({"draft_vocab_size": 10}, "draft_vocab_size 10"),
    ],
    ids=["naming", "architecture", "hidden-size", "depth", "flag", "draft-vocab"],
)
def test_bad_sidecar_config_is_a_draft_head_error(base, tmp_path, change, message):
    loaded, head = base
    path = sidecar(tmp_path / "cfg", head, loaded)
    _, config = sidecar_parts(path)
    for key, value in change.items():
        if isinstance(value, dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    rewrite(path, config=config)
    with pytest.raises(DraftHeadError, match=message) as err:
        load_draft_head(load_model(loaded.path), path)
    assert err.value.path.startswith(path)


def test_missing_sidecar_files_are_errors(base, tmp_path):
    loaded, _ = base
    with pytest.raises(DraftHeadError, match="config.json not found"):
        load_draft_head(loaded, str(tmp_path / "nowhere"))


# -- a real head beside a real target -------------------------------------------------------


def repeating_target(path) -> str:
    """A target whose blocks add nothing (zero o_proj/down_proj): with the tied embedding it
    predicts the token it was fed, so greedy output repeats and a matching head is accepted."""
    write_checkpoint(path, "llama", seed=0)
    file = os.path.join(path, "model.safetensors")
    weights = dict(mx.load(file))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(file, weights)
    return os.fspath(path)


def repeating_head(loaded):
    """A head whose block adds nothing and whose fc keeps only the embedding half: it drafts
    the token it is given."""
    head = random_head(loaded, seed=9)
    d = loaded.model.args.hidden_size
    head.fc.weight = mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)
    head.layers[0].self_attn.o_proj.weight = mx.zeros((d, d))
    head.layers[0].mlp.down_proj.weight = mx.zeros_like(head.layers[0].mlp.down_proj.weight)
    return head


def greedy_plain(model, prompt, count):
    caches = model.make_caches()
    logits, _ = model.forward(mx.array([prompt]), caches)
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < count:
        logits, _ = model.forward(mx.array([[out[-1]]]), caches)
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def drive(loaded, head, k: int = 3, rounds: int = 4):
    """Prefill in two chunks, two plain steps, then greedy speculative rounds; checks the
    draft KV offset against the target's at every stage. Returns (output, accepted per
    round, session, draft cache, fed tokens)."""
    model = loaded.model
    caches, cache = model.make_caches(), KVCache()
    ds = DraftSession(head, cache, model.unembed)
    params = SamplingParams(temperature=0.0)  # repeat penalty on: the chain matters
    sampler = Sampler(params, PROMPT, model.args.vocab_size, loaded.context_length)
    position = 0
    for chunk in (PROMPT[:8], PROMPT[8:]):
        logits, hidden = model.forward(mx.array([chunk]), caches)
        ds.committed(chunk, hidden, position)
        position += len(chunk)
    current = sampler.sample(logits[0, -1], slot=len(PROMPT))
    ds.settle(current)  # prefill done: level with the target
    assert cache.offset == ds.offset == caches[0].offset == len(PROMPT)
    current = int(current.item())
    out, fed = [current], list(PROMPT)
    for _ in range(2):  # plain decode reports every forward
        logits, hidden = model.forward(mx.array([[current]]), caches)
        ds.committed(mx.array([current]), hidden[0], position)
        sampler.append(current)
        fed.append(current)
        position += 1
        current = int(sampler.sample(logits[0, -1], slot=position).item())
        out.append(current)
    assert ds.offset + ds.pending == position - 1 and cache.offset <= position
    accepted_counts = []
    for _ in range(rounds):
        proposal = ds.propose(current, k, sampler, slot=position + 1)
        logits, hidden = model.forward(
            mx.concatenate([mx.array([current], dtype=mx.int32), proposal.tokens])[None], caches
        )
        target = sampler.tokens(logits[0], proposal.tokens, slot=position + 1)
        drafts, best = proposal.tokens.tolist(), target.tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        for c in caches:
            c.rewind(position + 1 + accepted)
        run = [current, *drafts[:accepted]]
        ds.committed(run, hidden[0, : accepted + 1], position)
        sampler.append(run)
        fed += run
        position += accepted + 1
        current = best[accepted]
        out += [*drafts[:accepted], current]
        accepted_counts.append(accepted)
        # The verified drafts' pairs wait for the next flush; their slots are still open.
        assert ds.offset == position - 1 - accepted and ds.pending == accepted
    ds.settle(current)
    ds.close()
    assert cache.offset == ds.offset == caches[0].offset == position
    return out, accepted_counts, ds, cache, fed


def one_shot_draft_kv(loaded, head, fed, final):
    """The draft KV of every pair of the sequence, built in one forward from one target pass."""
    _, hidden = loaded.model.forward(mx.array([fed]), loaded.model.make_caches())
    cache = KVCache()
    head(mx.array([fed[1:] + [final]]), hidden, cache)
    return cache


@pytest.mark.parametrize("kind", ["random", "repeating"])
def test_real_head_stays_level_with_the_target_and_commits_target_pairs(base, tmp_path, kind):
    loaded, head = base
    if kind == "repeating":
        loaded = load_model(repeating_target(tmp_path / "rep"))
        head = repeating_head(loaded)
    sidecar_dir = sidecar(tmp_path / "head", head, loaded)
    target = load_model(loaded.path)
    got, _ = load_draft_head(target, sidecar_dir)
    out, accepted, ds, cache, fed = drive(target, got)
    assert out == greedy_plain(target.model, PROMPT, len(out))
    if kind == "repeating":
        assert accepted == [3, 3, 3, 3] and len(set(out)) == 1
    else:
        assert sum(accepted) < 12  # random drafts get rejected
    ref = one_shot_draft_kv(target, got, fed, out[-1])
    assert ref.offset == cache.offset
    for a, b in ((cache.keys, ref.keys), (cache.values, ref.values)):
        np.testing.assert_allclose(
            np.array(a[..., : ref.offset, :]),
            np.array(b[..., : ref.offset, :]),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.default_model
def test_default_model_finds_its_shipped_head_or_says_why(default_loaded):
    head, why = load_draft_head(default_loaded)
    if not os.path.isdir(default_model.HEAD_DIR):
        assert head is None and default_model.HEAD_DIR in why
        return
    assert head is not None and default_model.HEAD_DIR in why
    # A short prompt drafts through the shipped head at the target's shapes.
    model = default_loaded.model
    ids = default_loaded.tokenizer.encode("<|im_start|>user\nCount to five.<|im_end|>\n")
    ds = DraftSession(head, KVCache(), model.unembed)
    logits, hidden = model.forward(mx.array([ids]), model.make_caches())
    ds.committed(ids, hidden, 0)
    sampler = Sampler(SamplingParams(temperature=0.0), ids, model.args.vocab_size, 2048)
    proposal = ds.propose(mx.argmax(logits[0, -1]), 2, sampler, slot=len(ids) + 1)
    mx.eval(proposal.tokens, ds.cache.state)
    assert proposal.tokens.shape == (2,)
    assert all(0 <= t < model.args.vocab_size for t in proposal.tokens.tolist())
    assert ds.offset == ds.cache.offset - 1 == len(ids)


def quantized(tensors: dict[str, mx.array], bits: dict[str, int]) -> dict[str, mx.array]:
    """mlx-lm's affine triples for the 2-D weights (``bits``: a substring -> bits, else 4)."""
    out = {}
    for name, value in tensors.items():
        if value.ndim != 2 or not name.endswith(".weight"):
            out[name] = value
            continue
        width = next((b for key, b in bits.items() if key in name), 4)
        base = name[: -len(".weight")]
        w, scales, biases = mx.quantize(value, group_size=32, bits=width)
        out.update({name: w, base + ".scales": scales, base + ".biases": biases})
    return out


def test_a_quantized_head_dequantizes_by_its_own_shapes(base, tmp_path):
    """A sidecar head quantized with its own recipe (8-bit fc, 4-bit elsewhere, group 32,
    unlike the float target): each triple is read from its shapes and drafts like the dense
    head it came from, within the quantization error."""
    loaded, head = base
    path = sidecar(tmp_path / "q", head, loaded)
    tensors, _ = sidecar_parts(path)
    packed = quantized(tensors, {"fc.": 8})
    rewrite(path, tensors=packed)
    got, why = load_draft_head(load_model(loaded.path), path)
    assert got is not None and path in why
    # The same head with every triple dequantized by hand, in float32.
    exact = sidecar(tmp_path / "exact", head, loaded)
    dense = {k: v for k, v in packed.items() if not k.endswith((".scales", ".biases"))}
    for name in [k for k in packed if k.endswith(".scales")]:
        stem = name[: -len(".scales")]
        bits = 8 if "fc." in stem + "." else 4
        dense[stem + ".weight"] = mx.dequantize(
            packed[stem + ".weight"], packed[name], packed[stem + ".biases"], 32, bits
        )
    rewrite(exact, tensors=dense)
    want, _ = load_draft_head(load_model(loaded.path), exact)
    np.testing.assert_allclose(head_outputs(loaded, got), head_outputs(loaded, want), atol=1e-5)


def test_a_broken_quantized_inline_head_leaves_the_target_running(base, tmp_path):
    loaded, head = base
    tensors = quantized(head_tensors(head, "deepseek"), {})
    del tensors["model.layers.2.eh_proj.biases"]
    target = load_model(checkpoint_with(tmp_path / "broken-q", tensors))
    none, why = load_draft_head(target)
    assert none is None and "model.layers.2.eh_proj.biases" in why
