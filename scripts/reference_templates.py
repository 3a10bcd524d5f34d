"""Expected chat-template renderings for tests/fixtures/templates/: every conversation below
through transformers' ``apply_chat_template`` (``tokenize=False``) with each model's own
template, written as ``<name>.json`` beside its ``<name>.jinja``.

Runs in the reference environment (``./scripts/reference_env.sh``), never in the runner's:

    .venv-ref/bin/python scripts/reference_templates.py
"""

from __future__ import annotations

import json
import os
import sys

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests", "fixtures", "templates")

# name -> the special tokens the model's tokenizer_config.json gives its template
SPECIAL = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2_5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "smollm2": {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

U = {"role": "user", "content": "What is the capital of France?"}
A = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": 'And of Italy? Answer in one word, with "quotes" & <tags>.'}
SYS = {"role": "system", "content": "You are terse. Answer in at most five words."}


def conversations(name: str) -> list[dict]:
    """Ten cases per template: plain, system, multi-turn, no generation prompt, unicode; tools,
    a tool call and its result where the template takes them; Qwen3's thinking switch."""
    cases = [
        {"messages": [U]},
        {"messages": [SYS, U]},
        {"messages": [U, A, U2]},
        {"messages": [SYS, U, A, U2], "add_generation_prompt": False},
        {"messages": [U, A], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "Übersetze: naïve café — ok? 你好 🙂"}]},
    ]
    if name == "smollm2":
        cases += [
            {"messages": [U, A, U2, {"role": "assistant", "content": "Rome."}, U]},
            {"messages": [{"role": "user", "content": ""}]},
            {"messages": [SYS, {"role": "user", "content": "line one\nline two\n\n  indented"}]},
            {"messages": [{"role": "system", "content": "Be kind."}, U, A]},
        ]
        return cases
    weather_q = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    result = {
        "role": "tool",
        "tool_call_id": "call12345",
        "name": "get_weather",
        "content": '{"temperature": 18, "unit": "celsius"}',
    }
    cases += [
        {"messages": [weather_q], "tools": [WEATHER]},
        {"messages": [SYS, weather_q], "tools": [WEATHER]},
        {"messages": [weather_q, call, result], "tools": [WEATHER]},
    ]
    if name == "qwen3":
        cases.append({"messages": [U], "template_kwargs": {"enable_thinking": False}})
        thought = {
            "role": "assistant",
            "content": "Paris.",
            "reasoning_content": "The user asks for a capital.",
        }
        cases[5] = {"messages": [U, thought, U2]}
    else:
        cases.append({"messages": [U, A, U2, {"role": "assistant", "content": "Rome."}, U]})
    return cases


def tokenizer(special: dict, template: str):
    words = sorted(set(special.values()))
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, "[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **special)
    tok.chat_template = template
    return tok


def main() -> int:
    for name, special in SPECIAL.items():
        with open(os.path.join(HERE, f"{name}.jinja"), encoding="utf-8") as f:
            template = f.read()
        tok = tokenizer(special, template)
        cases = []
        for case in conversations(name):
            kwargs = dict(case.get("template_kwargs") or {})
            entry = dict(case)
            try:
                entry["expected"] = tok.apply_chat_template(
                    case["messages"],
                    tools=case.get("tools"),
                    tokenize=False,
                    add_generation_prompt=case.get("add_generation_prompt", True),
                    **kwargs,
                )
            except Exception as exc:  # a template's raise_exception: the runner must refuse too
                entry["error"] = str(exc)
            cases.append(entry)
        record = {
            "special_tokens": special,
            "transformers": transformers.__version__,
            "cases": cases,
        }
        with open(os.path.join(HERE, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
            f.write("\n")
        errors = sum("error" in c for c in cases)
        print(f"{name}: {len(cases)} conversations ({errors} refused by the template)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
