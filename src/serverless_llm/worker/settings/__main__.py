"""`python -m serverless_llm.worker.settings`: print docs/settings.md (`--markdown`), or check
the current environment (the settings that differ from their defaults, and every limitation)."""

from __future__ import annotations

import argparse
import sys

from .docs import settings_markdown
from .loader import load_settings_or_exit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serverless_llm.worker.settings",
        description="Print the settings reference, or check the current environment.",
    )
    ap.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    settings = load_settings_or_exit()
    for key, value in settings.non_default().items():
        print(f"{key}={value}")
    for lim in settings.limitations():
        print(f"{lim.level}: {lim.message}")
    ignored = settings.ignored_engine_args_warning()
    if ignored:
        print(f"warning: {ignored}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
