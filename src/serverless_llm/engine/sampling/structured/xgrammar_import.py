"""The xgrammar import, in one place: a runtime dependency whose absence is reported at first
use (`require_xgrammar`), not at import."""

from __future__ import annotations

try:  # xgrammar is a runtime dependency; the import error is deferred to first use
    import xgrammar as xgr
except ImportError:  # pragma: no cover - exercised only in broken installs
    xgr = None  # type: ignore[assignment]

__all__ = ["require_xgrammar", "xgr"]


def require_xgrammar() -> None:
    if xgr is None:  # pragma: no cover
        raise RuntimeError("structured output needs the xgrammar package (pip install xgrammar)")
