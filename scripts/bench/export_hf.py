"""Export a model as a Hugging Face directory (float32 safetensors, config.json, tokenizer.json).

The benchmarks give this directory to mlx-lm, which loads Hugging Face layouts only. Weights
come from our own loader unpacked (``pack=False``), so they are exactly the tensors the runner
computes with: dequantized, Hugging Face names, Q/K rows un-permuted. Usage:

    python scripts/bench/export_hf.py [--model PATH] [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


# Written last: its presence (with a matching source) means the export is complete.
STAMP = "export_source.json"
_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
)


def default_export_dir(model_path: str) -> str:
    stem = os.path.splitext(os.path.basename(os.path.normpath(model_path)))[0]
    return os.path.join(os.path.expanduser("~/.cache/mtp-runner/hf"), stem)


def source_id(model_path: str) -> dict:
    st = os.stat(model_path)
    return {"path": os.path.abspath(model_path), "size": st.st_size, "mtime": int(st.st_mtime)}


def is_current(out_dir: str, model_path: str) -> bool:
    try:
        with open(os.path.join(out_dir, STAMP), encoding="utf-8") as f:
            return json.load(f) == source_id(model_path)
    except (OSError, ValueError):
        return False


def hf_config(loaded) -> dict:
    """A llama config.json that mlx-lm's own model code reads back to the same model."""
    args = loaded.model.args
    config = {"model_type": args.model_type, "architectures": ["LlamaForCausalLM"]}
    for key in _CONFIG_KEYS:
        config[key] = getattr(args, key)
    config["rope_traditional"] = bool(args.rope_traditional)
    config["tie_word_embeddings"] = bool(args.tie_word_embeddings)
    config["torch_dtype"] = "float32"
    eos = sorted(loaded.tokenizer.eos_ids)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if loaded.tokenizer.bos_id is not None:
        config["bos_token_id"] = loaded.tokenizer.bos_id
    return config


def tokenizer_config(loaded) -> dict:
    tok = loaded.tokenizer
    hf = tok.hf

    def piece(i: int | None) -> str | None:
        return None if i is None else hf.id_to_token(i)

    eos = sorted(tok.eos_ids)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(tok.add_bos),
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(eos[0]) if eos else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(loaded.context_length),
    }


def export(model_path: str, out_dir: str) -> str:
    """Write the export into ``out_dir`` (atomically enough: the stamp goes last)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runner.loader import load_model

    loaded = load_model(model_path, dtype="float32", keep_quantized=False)
    weights = dict(tree_flatten(loaded.model.parameters()))
    if loaded.model.args.model_type != "llama":
        raise SystemExit(
            f"export_hf: only llama models are supported, not {loaded.model.args.model_type}"
        )
    os.makedirs(out_dir, exist_ok=True)
    stamp = os.path.join(out_dir, STAMP)
    if os.path.exists(stamp):
        os.remove(stamp)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(loaded), f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(loaded.tokenizer.hf.to_str())
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(loaded), f, indent=2)
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(source_id(model_path), f)
    return out_dir


def ensure_export(model_path: str, out_dir: str | None = None, force: bool = False) -> str:
    out_dir = out_dir or default_export_dir(model_path)
    if force or not is_current(out_dir, model_path):
        export(model_path, out_dir)
    return out_dir


def ensure_export_in_child(model_path: str) -> str:
    """:func:`ensure_export` into the default directory from a child process, so the caller
    (a benchmark's parent, which must not load MLX itself) stays light; returns the directory."""
    import subprocess

    out_dir = default_export_dir(model_path)
    if not is_current(out_dir, model_path):
        print(f"exporting {model_path} to {out_dir} ...", file=sys.stderr)
        argv = [sys.executable, os.path.abspath(__file__), "--model", model_path, "--out", out_dir]
        subprocess.run(argv, check=True)
    return out_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--out", default=None, help="output directory")
    parser.add_argument("--force", action="store_true", help="export even if up to date")
    args = parser.parse_args()
    if args.model is None:
        from runner.default_model import ensure_default_model

        args.model = ensure_default_model()
    print(ensure_export(args.model, args.out, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
