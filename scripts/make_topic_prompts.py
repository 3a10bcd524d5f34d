"""Write the trainer's topic prompts (``drafting/training/prompts/templates_topics.json``) from
text this machine already has: the NAME lines of its section-1 man pages, the docstrings of
Python's standard library modules, the titles of Python's language-reference topics and the
short descriptions of the installed Debian packages.

The output is package data, committed: the prompt set stays the same wherever the trainer
runs, and rerunning this script on another machine only changes which topics are drawn.
Nothing is imported from the standard library (its modules are read with ``ast``), so no
module's import-time side effects run.

    python scripts/make_topic_prompts.py [--per-source 240] [--out PATH]
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import importlib.util
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "drafting", "training", "prompts", "templates_topics.json")
SEED = 0

# The templates each source fills; {x} is one drawn topic.
TEMPLATES = {
    "man": [
        ("topic_cmd_what", "What does the {x} command do on Linux? Show two typical invocations."),
        ("topic_cmd_script", "How would I use {x} in a shell script? Give a short example."),
        ("topic_cmd_newbie", "I am new to the terminal. When would I reach for {x}?"),
    ],
    "python": [
        ("topic_py_example", "Write a short Python example that uses the {x}."),
        (
            "topic_py_when",
            "When should a Python programmer use the {x}, and what are its pitfalls?",
        ),
        ("topic_py_teach", "Teach me the basics of the {x} in a few paragraphs."),
    ],
    "reference": [
        ("topic_lang_explain", "Explain {x} in Python, with a small example."),
        ("topic_lang_mistakes", "What mistakes do beginners make with {x} in Python?"),
    ],
    "packages": [
        ("topic_pkg_what", "What is {x} used for, and who would install it?"),
        ("topic_pkg_intro", "Write a short introduction for someone about to try {x}."),
        ("topic_pkg_compare", "What alternatives exist to {x}, and how do they differ?"),
    ],
}

_GROFF = re.compile(r"\\f[BIRP]|\\f\(..|\\&|\\\(..|\\[*]\(..|\\s[-+]?\d")


def _clean(text: str) -> str:
    text = _GROFF.sub("", text).replace("\\-", "-").replace("\\ ", " ").replace('\\"', "")
    return " ".join(text.split())


def _lower_first(text: str) -> str:
    """Sentence case inside a sentence, acronyms kept ("GNU core utilities")."""
    return text[0].lower() + text[1:] if text[1:2].islower() else text


def _plausible(summary: str) -> bool:
    return summary.isascii() and 12 <= len(summary) <= 90 and not summary.endswith(":")


def man_topics() -> list[str]:
    """``the `ls` command (list directory contents)`` from every section-1 NAME line."""
    found = {}
    for path in sorted(glob.glob("/usr/share/man/man1/*.1.gz")):
        try:
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                lines = f.read(20000).splitlines()
        except OSError:
            continue
        for i, line in enumerate(lines):
            if re.match(r'\.S[Hh]\s+"?NAME"?\s*$', line):
                after = lines[i + 1 : i + 4]
                if after and after[0].startswith(".Nm"):  # mdoc: .Nm name / .Nd summary
                    nd = [ln for ln in after if ln.startswith(".Nd")]
                    body = after[0][3:] + " - " + (nd[0][3:] if nd else "")
                else:  # man: the first text line, ``name \- summary``
                    body = next((ln for ln in after if not ln.startswith(".")), "")
                body = _clean(body)
                match = re.match(r"([A-Za-z0-9][\w.+-]*)(?:,[^-]*)?\s+-+\s+(.*)", body)
                if match and _plausible(match.group(2)):
                    name, summary = match.group(1), match.group(2).rstrip(".")
                    found.setdefault(name, f"`{name}` ({_lower_first(summary)})")
                break
    return sorted(found.values())


_SKIP_MODULES = re.compile(r"^(_|test|idlelib|tkinter|turtle|lib2to3|antigravity|this$)")


def python_topics() -> list[str]:
    """```json` module (JSON encoder and decoder)`` from each stdlib module's docstring."""
    found = []
    for name in sorted(sys.stdlib_module_names):
        if _SKIP_MODULES.match(name):
            continue
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None)
        if not origin or not origin.endswith(".py"):
            continue
        try:
            with open(origin, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read()))
        except (OSError, SyntaxError, ValueError):
            continue
        first = _clean((doc or "").strip().split("\n\n")[0])
        first = re.split(r"\s[=-]{3,}", first.split(". ")[0])[0].rstrip(".")
        if _plausible(first) and name.lower() not in first.lower()[:3]:
            found.append(f"`{name}` module ({_lower_first(first)})")
    return found


def reference_topics() -> list[str]:
    """The titles of the language reference's topics (``pydoc_data``), e.g. "the assert
    statement"."""
    from pydoc_data.topics import topics  # a data module: one dict literal

    found = set()
    for text in topics.values():
        title = text.strip().splitlines()[0].strip()
        title = title.replace('"', "").replace("*", "").strip()
        if 6 <= len(title) <= 60 and title.isascii():
            title = _lower_first(title)
            found.add(title if title.startswith("the ") else f"the topic '{title}'")
    return sorted(found)


def package_topics(status: str = "/var/lib/dpkg/status") -> list[str]:
    """``the Debian package curl (command line tool for transferring data...)``."""
    found = {}
    if not os.path.exists(status):
        return []
    name = None
    with open(status, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("Package: "):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Description: ") and name and not name.startswith("lib"):
                summary = line.split(":", 1)[1].strip().rstrip(".")
                if _plausible(summary):
                    found.setdefault(name, f"the {name} package ({_lower_first(summary)})")
    return sorted(found.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-source", type=int, default=240, help="topics drawn per source")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    sources = {
        "man": man_topics(),
        "python": python_topics(),
        "reference": reference_topics(),
        "packages": package_topics(),
    }
    templates = []
    for source, topics in sources.items():
        rng = random.Random(f"{SEED}:{source}")
        drawn = sorted(rng.sample(topics, min(args.per_source, len(topics))))
        print(f"{source}: {len(topics)} topics, {len(drawn)} drawn", file=sys.stderr)
        for template_id, text in TEMPLATES[source]:
            templates.append({"id": template_id, "text": text, "slots": {"x": drawn}})
    spec = {
        "category": "topics drawn from the machine's man pages, Python docs and package list",
        "templates": templates,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(templates)} templates", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
