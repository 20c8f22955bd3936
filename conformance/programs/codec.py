"""A program as one line of text and back: what the ``REPRO:`` command carries
(``--generate-replay``), and what an expectations entry may record.

JSON of the dataclasses with their type names, compressed and base64url-encoded so it survives a shell
unquoted. Decoding accepts only the program's own types.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import typing
import zlib
from typing import Any

from conformance.programs import program as program_module
from conformance.protocol import ApiForm, ShardingStrategy

_TYPES = {
    cls.__name__: cls
    for cls in (
        program_module.Program,
        program_module.ModelShape,
        program_module.Setup,
        *typing.get_args(program_module.Operation),  # every kind of operation, as it is added there
    )
}
_ENUMS = {"ShardingStrategy": ShardingStrategy, "ApiForm": ApiForm}


class ProgramCodeError(ValueError):
    """A replay text that is not a program this version of the suite can read."""


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "name": value.name}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _built(value: Any) -> Any:
    if isinstance(value, dict) and "enum" in value:
        return _ENUMS[value["enum"]][value["name"]]
    if isinstance(value, dict) and "type" in value:
        cls = _TYPES[value["type"]]
        fields = {k: _built(v) for k, v in value.items() if k != "type"}
        return cls(**fields)
    if isinstance(value, list):
        return tuple(_built(v) for v in value)
    return value


def encode(program: program_module.Program) -> str:
    text = json.dumps(_plain(program), separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode().rstrip("=")


def decode(text: str) -> program_module.Program:
    try:
        padded = text + "=" * (-len(text) % 4)
        program = _built(json.loads(zlib.decompress(base64.urlsafe_b64decode(padded.encode()))))
    except (ValueError, KeyError, TypeError, zlib.error) as error:
        raise ProgramCodeError(
            f"--generate-replay {text[:40]}...: not a generated program this suite can read ({error}); "
            "copy the whole text of the REPRO: line, from the same version of the suite"
        ) from None
    if not isinstance(program, program_module.Program):
        raise ProgramCodeError("--generate-replay: the text decodes to something other than a program")
    return program
