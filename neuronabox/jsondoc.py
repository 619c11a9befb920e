"""Reading the JSON documents nbox writes (calibration profiles, what-if sweeps): one error per way a file can be wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["read_document"]


def read_document(path: str | Path, label: str, fmt: str, missing: str = "") -> dict[str, Any]:
    """The JSON object in ``path`` whose ``format`` is ``fmt``; InputError starts with ``label`` and says what is wrong."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{label}: no such file{f' ({missing})' if missing else ''}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{label}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise InputError(f"{label}: format is {got!r}, expected {fmt!r}")
    return doc
