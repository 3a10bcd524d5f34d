"""Drafting on agent-like task families: plain, MTP head, suffix drafter, and both, in one run.

Families (``--prompts`` prompts each, built here from the standard library and a seeded
``random``, nothing downloaded), every prompt sent as chat ``messages``:

- ``code-edit``: a standard-library function (8-40 lines) and one edit: rename a parameter,
  add type hints, add a docstring, or negate one named condition; the reply is the function;
- ``extract-json`` / ``extract-json-format``: a paragraph about a synthetic record, returned as
  a JSON object with given keys; the second family sends the object's JSON schema as
  ``format`` (constrained output) for the same records;
- ``quote``: a module docstring, then "quote the paragraph that begins with ..." or "repeat
  the text, then summarise it";
- ``multi-turn``: a function and an edit, the assistant's reply (the edit made here, by
  regex), then a second edit that the model answers;
- ``chat``: open-ended prompts (scripts/bench/spec.py's), the control;
- ``retry``: chat's prompts asked again, the earlier answer in no prompt: the drafting
  engines of this family index recent outputs (``--recent-outputs``), and each answered
  every prompt once, untimed, before the measured run (a client retrying, an agent loop
  asking for the same file). Every other family's engines index none, so that no arm drafts
  from another arm's answer to the same prompt.

Arms: ``plain`` (``speculative: false`` on the ``both`` engine), ``head``
(``draft_sources=("head",)``), ``suffix`` (``("suffix",)``), ``both`` (``("head", "suffix")``),
one engine each, built once and warmed up; each engine's learned state (depth controller,
suffix model) carries over from family to family, as a server's would, and is saved after
each family. Per prompt and sampling mode (``greedy``; ``T=0.7`` with a seed fixed per prompt;
no repeat penalty) all arms run back to back, the first arm rotating from prompt to prompt so
drift of a shared machine falls on every arm. Every arm's token ids must equal plain's: a
mismatch is printed loudly, counted, and makes the exit status 1.

Reported per family x mode x arm: median tokens/s (eval_tokens / eval_ns) over prompts, the
median per-prompt ratio to plain, tokens per target forward (eval_tokens / (eval_tokens -
accepted): a round commits its accepted drafts plus one token, a plain step one token),
accepted/drafted and rounds per drafter, and each drafter's share of the tokens (its
accepted drafts / eval_tokens); then, per family and mode, how far a lookup drafter could go
on plain's answers (``lookup_bound``: an oracle's ceilings, from this index's runs and from
any earlier text's, at the learned round costs and with rows free). Markdown tables are
printed; JSON goes to ``--out``.

``--llamacpp`` adds llama.cpp (llama-cpp-python in ``.venv-llamacpp``, see
scripts/bench/llamacpp.py; one thread) on the same GGUF and the same rendered prompt ids,
greedy, with and without ``LlamaPromptLookupDecoding`` (``-format`` skipped: no grammar there).

    .venv/bin/python scripts/bench/workloads.py                      # 6 prompts, 192 tokens
    .venv/bin/python scripts/bench/workloads.py --prompts 2 --tokens 96 --modes greedy \\
        --families code-edit,chat --arms plain,both [--llamacpp] [--out FILE]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from drafting.suffix import RECENT_TOKENS  # noqa: E402
from scripts.bench import common as bc  # noqa: E402
from scripts.bench import lookup_bound  # noqa: E402
from scripts.bench.spec import PROMPTS  # noqa: E402

Job = dict[str, Any]  # {"messages": [...], "format": a JSON schema or None}
CODE_MODULES = ("textwrap", "shlex", "json.decoder", "csv", "string", "posixpath", "difflib")
CODE_MODULES += ("fnmatch", "json.encoder", "calendar", "heapq", "base64")
DOC_MODULES = ("string", "difflib", "heapq", "random", "tempfile", "tokenize", "sched")
DOC_MODULES += ("struct", "subprocess", "urllib.parse", "pprint", "getopt", "smtplib", "ast")
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0, "repeat_penalty": 1.0},
    "T=0.7": {"temperature": 0.7, "repeat_penalty": 1.0},
}
ARMS = ("plain", "head", "suffix", "both")
COUNTS = ("rounds", "drafted", "accepted")
SOURCES = {"head": ("head",), "suffix": ("suffix",), "both": ("head", "suffix")}
RENAMES = {"s": "text", "text": "source", "pat": "pattern", "name": "label", "a": "first"}
FIRST = ("Ada", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Brennan", "Haddad")
CITIES = ("Lisbon", "Osaka", "Tromso", "Valparaiso", "Krakow", "Nairobi", "Quebec", "Ghent")
JOBS = ("baker", "nurse", "carpenter", "librarian", "pilot", "chemist", "gardener", "teacher")
ITEMS = ("notebooks", "apples", "cables", "candles", "batteries", "mugs", "pens", "towels")


def schema(fields: dict[str, str]) -> dict[str, Any]:
    properties = {name: {"type": kind} for name, kind in fields.items()}
    return {"type": "object", "properties": properties, "required": list(fields)}


SCHEMA = schema({"name": "string", "city": "string", "age": "integer", "job": "string"})
SCHEMA["properties"]["items"] = {
    "type": "array",
    "items": schema({"item": "string", "quantity": "integer", "price": "number"}),
}
SCHEMA["required"].append("items")


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- families
def name_pattern(name: str) -> str:
    """A regex for a name as an identifier (not an attribute, not a string prefix)."""
    return rf"(?<![.\w]){re.escape(name)}\b(?!['\"])"


def functions() -> list[tuple[str, str, str]]:
    """(name, dedented source, a parameter used in the body) of 8-40 line standard-library
    functions and methods, in a fixed shuffled order."""
    out = []
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        for _, obj in sorted(vars(module).items()):
            members = [obj]
            if inspect.isclass(obj):
                members = [v for _, v in sorted(vars(obj).items())]
            for fn in members:
                if not inspect.isfunction(fn) or fn.__module__ != module_name:
                    continue
                try:
                    source = textwrap.dedent(inspect.getsource(fn))
                except (OSError, TypeError):
                    continue
                if not 8 <= source.count("\n") <= 40:
                    continue
                body = source.split(":", 1)[-1]
                params = [
                    p
                    for p, spec in inspect.signature(fn).parameters.items()
                    if p not in ("self", "cls") and spec.kind is spec.POSITIONAL_OR_KEYWORD
                    if len(re.findall(name_pattern(p), body)) >= 2
                ]
                if params:
                    out.append((f"{module_name}.{fn.__qualname__}", source, params[0]))
    random.Random("workloads-functions").shuffle(out)
    return out


def condition(source: str) -> tuple[str, int] | None:
    """The first if/elif/while condition of a source written on one line, and its line."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    tests = [
        n.test
        for n in ast.walk(tree)
        if isinstance(n, ast.If | ast.While) and n.test.lineno == n.test.end_lineno
    ]
    first = min(tests, key=lambda t: (t.lineno, t.col_offset), default=None)
    return (ast.get_source_segment(source, first), first.lineno - 1) if first else None


def edit(kind: str, source: str, param: str) -> tuple[str, str | None, str]:
    """An edit's instruction, the edited source where it is mechanical (else None), and the
    parameter's name afterwards."""
    found = condition(source)
    if kind == "condition" and found:
        cond, line = found
        lines = source.splitlines(keepends=True)
        lines[line] = lines[line].replace(cond, f"not ({cond})", 1)
        ask = f"Change the condition `{cond}` to `not ({cond})`; change nothing else."
        return ask, "".join(lines), param
    if kind == "hints":
        return "Add type hints to every parameter and to the return value.", None, param
    if kind == "docstring":
        return "Add a docstring (or rewrite the one it has) saying what it does.", None, param
    new_name = RENAMES.get(param, f"{param}_value")
    renamed = re.sub(name_pattern(param), new_name, source)
    return f"Rename the parameter `{param}` to `{new_name}` everywhere in it.", renamed, new_name


def fenced(source: str) -> str:
    return f"```python\n{source}```"


def code_edit(n: int) -> list[Job]:
    kinds = ("rename", "hints", "docstring", "condition")
    jobs = []
    for i, (_, source, param) in enumerate(functions()[:n]):
        instruction = edit(kinds[i % 4], source, param)[0]
        text = f"{instruction} Reply with the full function.\n\n{fenced(source)}"
        jobs.append({"messages": user(text), "format": None})
    return jobs


def multi_turn(n: int) -> list[Job]:
    """Functions after code-edit's: a mechanical first edit answered, then a second one."""
    jobs = []
    for i, (_, source, param) in enumerate(functions()[n : 2 * n]):
        first = "condition" if i % 2 and condition(source) else "rename"
        ask, edited, param = edit(first, source, param)
        second = ("docstring", "hints", "rename" if first == "condition" else "condition")[i % 3]
        follow = edit(second, edited or source, param)[0]
        messages = [
            *user(f"{ask} Reply with the full function.\n\n{fenced(source)}"),
            {"role": "assistant", "content": fenced(edited or source)},
            *user(f"Good. Now one more change: {follow} Reply with the full function."),
        ]
        jobs.append({"messages": messages, "format": None})
    return jobs


def records(n: int) -> list[str]:
    """Paragraphs about synthetic people and their shopping (the same for both JSON families)."""
    rng, out = random.Random("workloads-records"), []
    for _ in range(n):
        first, last, city = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES)
        age, job = rng.randint(19, 78), rng.choice(JOBS)
        bought = ", ".join(
            f"{rng.randint(1, 40)} {item} at {rng.randint(50, 5000) / 100:.2f} each"
            for item in rng.sample(ITEMS, rng.randint(3, 5))
        )
        out.append(
            f"{first} {last} is a {age}-year-old {job} who lives in {city}. On a Saturday "
            f"market trip {first} bought {bought}, and then went home to write it all down in "
            "a notebook before dinner."
        )
    return out


def extract(n: int, constrained: bool) -> list[Job]:
    ask = (
        'Return a JSON object with the keys "name", "city", "age", "job" and "items" (a list '
        'of objects with "item", "quantity" and "price") for the person in this text. Reply '
        "with the JSON only.\n\n"
    )
    schema = SCHEMA if constrained else None
    return [{"messages": user(ask + prose), "format": schema} for prose in records(n)]


def quote(n: int) -> list[Job]:
    docs = [(m, inspect.getdoc(importlib.import_module(m)) or "") for m in DOC_MODULES]
    jobs = []
    for i, (name, doc) in enumerate(d for d in docs if 400 <= len(d[1]) <= 1500):
        if i == n:
            break
        paragraphs = [p for p in doc.split("\n\n") if len(p) >= 80]
        if i % 2 == 0 and paragraphs:
            words = " ".join(paragraphs[len(paragraphs) // 2].split()[:6])
            ask = f'Quote the paragraph that begins with "{words}" exactly, word for word.'
        else:
            ask = "Repeat the text above exactly, then summarise it in one sentence."
        text = f'The documentation of the Python module `{name}`:\n\n"""\n{doc}\n"""\n\n{ask}'
        jobs.append({"messages": user(text), "format": None})
    return jobs


FAMILIES: dict[str, Callable[[int], list[Job]]] = {
    "code-edit": code_edit,
    "extract-json": lambda n: extract(n, False),
    "extract-json-format": lambda n: extract(n, True),
    "quote": quote,
    "multi-turn": multi_turn,
    "chat": lambda n: [{"messages": user(p), "format": None} for p in PROMPTS[:n]],
    "retry": lambda n: [{"messages": user(p), "format": None} for p in PROMPTS[:n]],
}
RETRY = "retry"  # the family whose engines index recent outputs


# ----------------------------------------------------------------------------- running
def request(job: Job, speculative: bool, tokens: int, sampling: dict) -> Any:
    from protocol.requests import Completion, Options

    options = Options(num_predict=tokens, **sampling)
    return Completion(id="w", speculative=speculative, options=options, **job)


def run_one(engine: Any, job: Job, speculative: bool, tokens: int, sampling: dict) -> tuple:
    frames: list = []
    engine.run(engine.prepare(request(job, speculative, tokens, sampling)), frames.append, bool)
    ids = [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]
    return frames[-1], ids


def sampling_for(mode: str, job: Job) -> dict:
    seed = zlib.crc32(json.dumps(job["messages"]).encode()) & 0x7FFFFFFF
    return {**MODES[mode], "seed": seed} if MODES[mode]["temperature"] > 0 else MODES[mode]


def source_counts(speculation: Any, source: str) -> dict[str, int]:
    counts = speculation.sources.get(source, {})  # plain dicts in process, else SourceCounts
    get = counts.get if isinstance(counts, dict) else lambda k, _: getattr(counts, k)
    return {k: int(get(k, 0)) for k in COUNTS}


def summarise(rows: list[dict]) -> dict:
    tokens = sum(r["eval_tokens"] for r in rows)
    out: dict[str, Any] = {
        "tps": statistics.median(r["tps"] for r in rows),
        "ratio": statistics.median(r["ratio"] for r in rows),
        "tokens_per_forward": tokens / max(1, sum(r["forwards"] for r in rows)),
        "identical": sum(r["identical"] for r in rows),
        "prompts": len(rows),
    }
    for source in ("head", "suffix"):
        s = {k: sum(r["sources"][source][k] for r in rows) for k in COUNTS}
        out[source] = {**s, "share": s["accepted"] / max(1, tokens)}
    names = set.intersection(*(set(r.get("ceiling", {})) for r in rows)) if rows else set()
    out["ceiling"] = {n: statistics.median(r["ceiling"][n] for r in rows) for n in sorted(names)}
    return out


# Runs in llama.cpp's venv: argv[1] is a JSON file {path, threads, tokens, eos, prompts: [{key,
# ids}]}; prints, per prompt and side, the greedy ids and tokens/s from first to last token.
LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
job = json.load(open(sys.argv[1]))
def load(draft):  # a draft forces logits_all, but the score rows follow the argument
    return Llama(model_path=job["path"], n_ctx=4096, n_batch=512, n_threads=job["threads"],
                 n_threads_batch=job["threads"], draft_model=draft, logits_all=bool(draft),
                 verbose=False)
sides = {"llama.cpp": load(None), "llama.cpp lookup": load(LlamaPromptLookupDecoding())}
def decode(llm, ids, n):
    llm.reset()
    out, stamps = [], []
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        if token in job["eos"]:
            break
        out.append(int(token))
        stamps.append(time.perf_counter())
        if len(out) == n:
            break
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"ids": out, "tps": (len(out) - 1) / span if span else None}
for llm in sides.values():
    decode(llm, job["prompts"][0]["ids"], 16)
results = []
for i, prompt in enumerate(job["prompts"]):
    for side in list(sides)[:: 1 if i % 2 == 0 else -1]:
        got = decode(sides[side], prompt["ids"], job["tokens"])
        results.append({"key": prompt["key"], "side": side, **got})
print(json.dumps(results))
"""


def llamacpp_side(model: str, prompts: list[dict], eos: list[int], tokens: int) -> list[dict]:
    """llama.cpp's greedy decode of the same prompt ids, without and with prompt lookup."""
    from scripts.bench.llamacpp import ensure_llama_venv

    python = ensure_llama_venv(skip_build=True)
    # One thread: llama.cpp's threads spin at barriers, and on a small shared machine a thread
    # that loses its core stalls the others (two threads measured from 6 to 80 tok/s).
    job = {"path": model, "threads": 1, "tokens": tokens, "eos": eos}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({**job, "prompts": prompts}, f)
        f.flush()
        done = subprocess.run([python, "-c", LLAMA_CHILD, f.name], capture_output=True, text=True)
    if done.returncode:
        print(f"llama.cpp failed ({done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return []
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_table(results: list[dict], plain_ids: dict[str, list[int]], summary: dict) -> str:
    """Per family, greedy: median tokens/s of the runner (plain, both drafters) and llama.cpp
    (without, with prompt lookup), and how many of the runner's plain tokens each llama.cpp
    side reproduced before its first difference."""
    lines = ["| family | plain | both | llama.cpp | lookup | lookup x | agree (lookup) |"]
    lines.append("|" + "---|" * 7)
    for family in dict.fromkeys(r["key"].split("#")[0] for r in results):
        keys = [k for k in plain_ids if k.split("#")[0] == family]
        tps, agree, total = [], [], sum(len(plain_ids[k]) for k in keys)
        for side in ("llama.cpp", "llama.cpp lookup"):
            rows = [r for r in results if r["side"] == side and r["key"].split("#")[0] == family]
            tps.append(statistics.median(r["tps"] or 0.0 for r in rows))
            diffs = [(r["ids"], plain_ids[r["key"]]) for r in rows]
            agree.append(sum(len(b) if a == b else bc.first_difference(a, b) for a, b in diffs))
        ours = summary[family]["greedy"]
        both = f"{ours['both']['tps']:.1f}" if "both" in ours else "-"
        lines.append(
            f"| {family} | {ours['plain']['tps']:.1f} | {both} | {tps[0]:.1f} | {tps[1]:.1f} | "
            f"{tps[1] / max(tps[0], 1e-9):.2f} | {agree[0]}/{total} ({agree[1]}/{total}) |"
        )
    return "\n".join(lines)


def write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def build(model: str, arms: list[str], recent: int) -> dict:
    """One engine per drafting arm (``plain`` runs on ``both``'s with speculation off), each
    indexing ``recent`` tokens of recent outputs, warmed up."""
    from runner.engine import Engine, EngineOptions

    engines = {}
    for arm in sorted({"both", *arms} - {"plain"}):
        options = EngineOptions(model_path=model, draft_sources=SOURCES[arm], recent_outputs=recent)
        engine = engines[arm] = Engine(options)
        print(f"{arm}: drafts from {engine.info.draft_sources}; {engine.info.mtp_detail}")
        if engine.info.draft_sources != SOURCES[arm]:
            raise SystemExit(f"{arm}: the engine drafts from {engine.info.draft_sources}")
    engines["plain"] = engines["both"]
    for arm in arms:  # kernels, allocator, the constraint path, both sampling modes
        for job in (code_edit(1)[0], extract(1, True)[0]):
            for mode in MODES:
                run_one(engines[arm], job, arm != "plain", 24, sampling_for(mode, job))
    return engines


def measure(
    engines: dict, arms: list[str], family: str, mode: str, i: int, job: Job, tokens: int
) -> tuple[list[dict], list[int]]:
    """One prompt in one mode on every arm, the first arm rotating with i: the records, and
    plain's ids."""
    sampling = sampling_for(mode, job)
    order = arms[i % len(arms) :] + arms[: i % len(arms)]
    got = {arm: run_one(engines[arm], job, arm != "plain", tokens, sampling) for arm in order}
    plain_done, plain_ids = got["plain"]
    plain_tps = plain_done.eval_tokens / max(1, plain_done.eval_ns) * 1e9
    ceilings = ceiling_row(engines, job, sampling, plain_ids, got, plain_tps)
    out = []
    for arm in arms:
        done, ids = got[arm]
        sp, tps = done.speculation, done.eval_tokens / max(1, done.eval_ns) * 1e9
        diff = bc.first_difference(ids, plain_ids)
        row = dict(family=family, mode=mode, prompt=i, arm=arm, tps=tps, ratio=tps / plain_tps)
        row.update(eval_tokens=done.eval_tokens, eval_ns=done.eval_ns, rounds=sp.rounds)
        row.update(prompt_tokens=done.prompt_tokens, done_reason=done.done_reason)
        row.update(drafted=sp.drafted, accepted=sp.accepted, identical=diff is None)
        row.update(first_difference=diff, forwards=max(1, done.eval_tokens - sp.accepted))
        row["sources"] = {s: source_counts(sp, s) for s in ("head", "suffix")}
        row["ceiling"] = ceilings
        out.append(row)
    return out, plain_ids


def ceiling_row(
    engines: dict, job: Job, sampling: dict, ids: list[int], got: dict, plain_tps: float
) -> dict[str, float]:
    """The oracle's ceilings on this answer (scripts/bench/lookup_bound.py): the index's runs
    and any earlier text's, each at the suffix model's learned round costs with the head's
    measured rate elsewhere (1 without a head arm), and any text's with rows free (a verify
    round of any length costs one plain step)."""
    speculation = engines["both"].speculation
    if speculation is None or speculation.suffix is None:
        return {}
    # The suffix model's own prices of a round, as they stand now, per row count.
    learned = [speculation.suffix.relative_cost(rows) for rows in range(lookup_bound.ROWS + 1)]
    prompt = list(engines["both"].prepare(request(job, False, 1, sampling)).prompt)
    head = 1.0
    if "head" in got:
        done = got["head"][0]
        head = done.eval_tokens / max(1, done.eval_ns) * 1e9 / plain_tps
    runs = {
        "index": lookup_bound.index_runs(prompt, ids),
        "any": lookup_bound.any_runs(prompt, ids),
    }
    out = {name: lookup_bound.ceiling(r, learned.__getitem__, head) for name, r in runs.items()}
    out["any, rows free"] = lookup_bound.ceiling(runs["any"], lambda rows: 1.0, head)
    out["copyable"] = sum(1 for r in runs["any"] if r) / max(1, len(ids))
    return out


def table(records: list[dict], families: list[str], modes: list[str], arms: list[str]) -> tuple:
    """The markdown table and the summary per family, mode and arm."""
    summary: dict[str, Any] = {}
    lines = [
        "| family | mode | arm | tok/s | x plain | tok/fwd | head acc/drafted (rounds) "
        "| suffix acc/drafted (rounds) | head share | suffix share | = plain |",
        "|" + "---|" * 11,
    ]
    for family in families:
        for mode in modes:
            for arm in arms:
                key = (family, mode, arm)
                rows = [r for r in records if (r["family"], r["mode"], r["arm"]) == key]
                s = summary.setdefault(family, {}).setdefault(mode, {})[arm] = summarise(rows)
                h, x = s["head"], s["suffix"]
                lines.append(
                    f"| {family} | {mode} | {arm} | {s['tps']:.1f} | {s['ratio']:.2f} | "
                    f"{s['tokens_per_forward']:.2f} | {h['accepted']}/{h['drafted']} "
                    f"({h['rounds']}) | {x['accepted']}/{x['drafted']} ({x['rounds']}) | "
                    f"{h['share']:.2f} | {x['share']:.2f} | {s['identical']}/{s['prompts']} |"
                )
    return "\n".join(lines), summary


def ceiling_table(summary: dict, families: list[str], modes: list[str]) -> str:
    """Per family and mode: the measured ratios beside the oracle's ceilings (medians over
    prompts; ``lookup_bound``), and the share of the answer's tokens some lookup draft holds."""
    lines = [
        "| family | mode | head | both | ceiling, index | ceiling, any text "
        "| any text, rows free | copyable |",
        "|" + "---|" * 8,
    ]
    for family in families:
        for mode in modes:
            arms = summary[family][mode]
            c = arms["plain"].get("ceiling", {})
            if not c:
                continue
            got = [f"{arms[a]['ratio']:.2f}" if a in arms else "-" for a in ("head", "both")]
            lines.append(
                f"| {family} | {mode} | {' | '.join(got)} | {c['index']:.2f} | {c['any']:.2f} "
                f"| {c['any, rows free']:.2f} | {c['copyable']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per family")
    parser.add_argument("--tokens", type=int, default=192, help="num_predict per completion")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--arms", default=",".join(ARMS), help="plain always runs (reference)")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp prompt lookup")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-results", "workloads.json"))
    args = parser.parse_args()
    families, modes = args.families.split(","), args.modes.split(",")
    arms = ["plain", *[a for a in args.arms.split(",") if a != "plain"]]
    for given, known in ((families, FAMILIES), (modes, MODES), (arms, ARMS)):
        if unknown := [x for x in given if x not in known]:
            parser.error(f"unknown {unknown}; known: {list(known)}")

    from runner.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    sets = {False: build(model, arms, 0)}
    if RETRY in families:
        sets[True] = build(model, arms, RECENT_TOKENS)
    engines = sets[False]
    print(f"tuning: {engines['both'].info.tuning}; load {os.getloadavg()}")

    records: list[dict] = []
    greedy_plain: dict[str, list[int]] = {}
    lookup_prompts: list[dict] = []
    states: dict[str, dict] = {}  # each drafting engine's learned state after each family
    started = time.time()
    for family in families:
        jobs = FAMILIES[family](args.prompts)
        engines = sets[family == RETRY]
        for mode in modes:
            for i, job in enumerate(jobs):
                if family == RETRY:  # the earlier ask, untimed: its answer is indexed
                    for arm in set(arms) - {"plain"}:
                        run_one(engines[arm], job, False, args.tokens, sampling_for(mode, job))
                rows, plain_ids = measure(engines, arms, family, mode, i, job, args.tokens)
                records += rows
                for r in (r for r in rows if not r["identical"]):
                    print(f"!!! MISMATCH {r['arm']}: token {r['first_difference']}", flush=True)
                speeds = "  ".join(f"{r['arm']} {r['tps']:6.1f} x{r['ratio']:.2f}" for r in rows)
                print(f"  {family:19s} {mode:6s} #{i}  {speeds}", flush=True)
                if mode == "greedy" and job["format"] is None:
                    key = f"{family}#{i}"
                    greedy_plain[key] = plain_ids
                    prepared = engines["both"].prepare(request(job, False, 1, MODES[mode]))
                    lookup_prompts.append({"key": key, "ids": list(prepared.prompt)})
        states[family] = {a: e.status()["speculation"] for a, e in engines.items() if a != "plain"}
    seconds = time.time() - started

    text, summary = table(records, families, modes, arms)
    mismatches = [r for r in records if not r["identical"]]
    print(f"\n{text}\n\n{ceiling_table(summary, families, modes)}")
    print(f"\n{len(records)} completions in {seconds:.0f} s; load {os.getloadavg()}")
    for r in mismatches:
        where = f"{r['family']} {r['mode']} #{r['prompt']} {r['arm']}"
        print(f"!!! MISMATCH {where}: differs from plain at token {r['first_difference']}")
    print(f"!!! {len(mismatches)} OUTPUTS DIFFER FROM PLAIN" if mismatches else "all equal plain")
    report: dict[str, Any] = dict(model=model, tokens=args.tokens, seconds=seconds, states=states)
    report.update(load=os.getloadavg(), mismatches=len(mismatches), summary=summary)
    report.update(prompts=args.prompts, records=records)
    write(args.out, report)
    if args.llamacpp and lookup_prompts:
        eos = sorted(engines["both"].tokenizer.eos_ids)
        report["llamacpp"] = llamacpp_side(model, lookup_prompts, eos, args.tokens)
        if report["llamacpp"]:
            print("\n" + llamacpp_table(report["llamacpp"], greedy_plain, summary))
        write(args.out, report)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
