"""Keyword checking for the public constructors: a typo fails at once, naming the closest valid keyword."""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping


def check_keywords(owner: str, given: Mapping[str, Any], valid: Iterable[str]) -> None:
    """Raise TypeError for the first key of ``given`` not in ``valid``: ``owner got an unexpected keyword argument
    `name`; did you mean `closest`?``."""
    valid = list(valid)
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else f"; valid keywords: {', '.join(sorted(valid))}"
            raise TypeError(f"{owner} got an unexpected keyword argument `{name}`{hint}")
