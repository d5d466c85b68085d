"""The server's API keys, as llama-server takes them: ``--api-key`` (a comma-separated list),
``--api-key-file`` (one key a line, ``#`` lines are comments), both together, or ``$MINFER_API_KEY``
(a comma-separated list) when neither flag is given. A request may use any one of them.

A flag that yields no key at all is an error rather than a server without a key: ``--api-key ""`` or an
empty file would otherwise open the server to anyone while its operator believes it closed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from minfer.errors import BadRequestError

ENV_VARIABLE = "MINFER_API_KEY"


def parse_api_keys(value: str, source: str = "--api-key") -> tuple[str, ...]:
    """The keys of a comma-separated list; none at all is a one-line error naming ``source``."""
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys:
        raise BadRequestError(f"{source}: no key given (an empty key would leave the server open)")
    return keys


def read_api_key_file(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The keys of a file, one a line; blank lines and lines starting with ``#`` are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadRequestError(f"--api-key-file: cannot read {path}: {e}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    if not keys:
        raise BadRequestError(f"--api-key-file: {path} holds no key (one a line; '#' lines are comments)")
    return keys


def server_api_keys(flag_keys: str | None, key_file: str | None) -> tuple[str, ...]:
    """The keys the flags give, in order and without repeats (empty: neither flag was given)."""
    keys = (parse_api_keys(flag_keys) if flag_keys is not None else ()) + (
        read_api_key_file(key_file) if key_file is not None else ())
    return tuple(dict.fromkeys(keys))


def resolve_api_keys(given: tuple[str, ...], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``given`` (the flags' keys), else ``$MINFER_API_KEY``'s; empty: the server wants no key."""
    if given:
        return given
    value = environ.get(ENV_VARIABLE, "")
    return parse_api_keys(value, f"${ENV_VARIABLE}") if value.strip() else ()
