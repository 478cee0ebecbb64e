"""Where a client finds the server's bearer token: one rule for the probe, the people CLI and the Python client.

``traindx serve`` writes its token to ``DATA/token`` (mode 0600) on first start, DATA being ``--data``,
``$TRAINDX_DATA`` or ``.traindx``; a client started in the same directory (or with the same TRAINDX_DATA)
finds it there. ``$TRAINDX_TOKEN`` comes first: it is how a client is given the token of a server whose data
directory it cannot read. The standard library only: the probe calls this inside the training process.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKEN_ENV = "TRAINDX_TOKEN"
DATA_ENV = "TRAINDX_DATA"
DEFAULT_DATA_DIR = ".traindx"
TOKEN_FILE = "token"


def token_file() -> Path:
    """The token file of the server whose data directory is ``$TRAINDX_DATA`` (else ``.traindx``), absolute."""
    return (Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR) / TOKEN_FILE).absolute()


def find_token() -> str | None:
    """``$TRAINDX_TOKEN``, else the token in ``token_file()``; None when neither holds one. Read anew at each
    call: a server started after its client writes the file then."""
    token = (os.environ.get(TOKEN_ENV) or "").strip()
    if token:
        return token
    try:
        return token_file().read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def token_places() -> str:
    """Where ``find_token`` looks, for a message that tells a person how to give a client its token."""
    return f"${TOKEN_ENV}, then {token_file()} (the file `traindx serve` writes in its data directory, ${DATA_ENV})"
