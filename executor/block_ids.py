"""Block ids and the file-name-safe keys made from them.

A block id is either a 64-bit unsigned block hash (what decisions carry) or a short
string id (what some engines use, e.g. LMCache keys). Tiers store blocks under a
*key*: 16 lowercase hex digits for an int, the string itself for a string that
passes the checks below. Keys become file names in the directory tiers, so every
id is validated before it gets anywhere near a path: no separators, no ``..``, no
leading dot (the tiers' own ``.tmp``/``.quarantine`` namespace), no NUL or other
control characters, at most ``MAX_KEY_CHARS`` characters.
"""

from __future__ import annotations

import re

BlockId = int | str
"""What callers pass to identify a block."""

MAX_BLOCK_HASH = (1 << 64) - 1
MAX_KEY_CHARS = 128
_KEY_RE = re.compile(r"[0-9A-Za-z_][0-9A-Za-z_.\-]*")
_HEX16_RE = re.compile(r"[0-9a-f]{16}")


class InvalidBlockIdError(ValueError):
    """A block id cannot be used as a key (it could escape a tier directory or is
    malformed). The message says which rule it broke and what an id must look like."""

    def __init__(self, block_id: object, problem: str) -> None:
        self.block_id = block_id
        shown = repr(block_id)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        super().__init__(
            f"invalid block id {shown}: {problem}; use an int in [0, 2**64) or a string of "
            f"1-{MAX_KEY_CHARS} characters from [0-9A-Za-z_.-] not starting with '.' or '-'"
        )


def block_key(block_id: object) -> str:
    """Validate ``block_id`` and return the key it is stored under.

    Ints map to 16 hex digits so that keys sort and round-trip (``key_to_block_id``).
    """
    # Fast path (called several times per decision): a plain int in range.
    if type(block_id) is int and 0 <= block_id <= MAX_BLOCK_HASH:
        return f"{block_id:016x}"
    # A key already (tiers are called with keys): the character class excludes NUL and
    # separators; the checks below say which rule a bad id broke.
    if (
        type(block_id) is str
        and len(block_id) <= MAX_KEY_CHARS
        and ".." not in block_id
        and _KEY_RE.fullmatch(block_id) is not None
    ):
        return block_id
    if isinstance(block_id, bool):
        raise InvalidBlockIdError(block_id, "booleans are not block ids")
    if isinstance(block_id, int):
        if not 0 <= block_id <= MAX_BLOCK_HASH:
            raise InvalidBlockIdError(block_id, "int ids must fit in 64 unsigned bits")
        return f"{block_id:016x}"
    if not isinstance(block_id, str):
        raise InvalidBlockIdError(block_id, f"type {type(block_id).__name__} is not an id")
    if not block_id:
        raise InvalidBlockIdError(block_id, "empty string")
    if len(block_id) > MAX_KEY_CHARS:
        raise InvalidBlockIdError(block_id, f"longer than {MAX_KEY_CHARS} characters")
    if "\x00" in block_id:
        raise InvalidBlockIdError(block_id, "contains a NUL byte")
    if "/" in block_id or "\\" in block_id:
        raise InvalidBlockIdError(block_id, "contains a path separator")
    if ".." in block_id:
        raise InvalidBlockIdError(block_id, "contains '..'")
    if not _KEY_RE.fullmatch(block_id):
        raise InvalidBlockIdError(block_id, "contains a character outside [0-9A-Za-z_.-]")
    return block_id


def key_to_block_id(key: str) -> BlockId:
    """Inverse of ``block_key``: 16 hex digits come back as the int hash."""
    if len(key) == 16 and _HEX16_RE.fullmatch(key):
        return int(key, 16)
    return key
