"""JSON Schema of the wire, generated from the Structs: `python -m protocol.schema`.

The output is checked in as docs/protocol.schema.json; a test fails when the two differ.
"""

from __future__ import annotations

import json

import msgspec

from protocol.codes import DONE_REASONS, ERROR_CODES, LOAD_ERROR_CODES, PROTOCOL_VERSION
from protocol.frames import Frame
from protocol.requests import Request


def protocol_schema() -> dict:
    (request, frame), components = msgspec.json.schema_components(
        (Request, Frame), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "mtp-runner line-delimited JSON protocol",
        "description": (
            "Each line on the runner's stdin is one `request`; each line on its stdout is one "
            "`frame`. Unknown fields in requests are ignored. See docs/PROTOCOL.md."
        ),
        "protocol_version": PROTOCOL_VERSION,
        "error_codes": list(ERROR_CODES),
        "load_error_codes": list(LOAD_ERROR_CODES),
        "done_reasons": list(DONE_REASONS),
        "request": request,
        "frame": frame,
        "$defs": components,
    }


def render() -> str:
    return json.dumps(protocol_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
