"""Assertions on the project's refusals."""

from __future__ import annotations

import pytest


def one_line_error(error: type[BaseException], call, *fragments: str) -> None:
    """`call()` raises `error` with a one-line message holding every fragment."""
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
