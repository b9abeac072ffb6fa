"""The console's deploy form, `worker-config.json`, generated from the worker's settings.

    python -m serverless_llm.worker.console_form > worker-config.json

`versions` names the image of this release and the CUDA version its hosts need, with the
settings grouped in the console's categories; `schema` holds one entry per environment variable
(`env_var_name`, default `value`, `title`, `description`, `required`, `type` and, for a select,
its `options`). Everything comes from `settings_metadata()`, so the form, docs/settings.md and
what the worker accepts cannot drift apart (a test compares the committed file with this
output, and each default with what the worker parses).

Form types: `toggle` for booleans (a JSON boolean), `number` for integers and floats (a JSON
number, "" when unset), `select` for a fixed set of choices (values as the strings the console
writes into the environment, "" for unset), `text` for the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .. import __version__
from .settings import CATEGORIES, settings_metadata

# The image this release's form deploys: the CUDA 12.6 variant runs on the widest range of host
# drivers. docker-bake.hcl builds it under the same name.
DEFAULT_IMAGE = "docker.io/serverless-llm/worker"
DEFAULT_CUDA = "12.6"
REQUIRED = frozenset({"MODEL_NAME"})  # the deployed worker stops at start without it


def _value(row: dict[str, Any]) -> Any:
    default = row["default"]
    if row["form_type"] == "toggle":
        return bool(default)
    if default is None:
        return ""
    if row["form_type"] == "select":
        return str(default)
    return default


def _schema_entry(row: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "env_var_name": row["env"],
        "value": _value(row),
        "title": row["title"],
        "description": row["description"],
        "required": row["env"] in REQUIRED,
        "type": row["form_type"],
    }
    if row["form_type"] == "select":
        options = [{"value": str(c), "label": str(c)} for c in row["choices"]]
        if row["default"] is None:
            options.insert(0, {"value": "", "label": "unset"})
        entry["options"] = options
    return entry


def console_form(
    image: str = DEFAULT_IMAGE,
    version: str = __version__,
    cuda: str = DEFAULT_CUDA,
) -> dict[str, Any]:
    """The whole form: one version (this release's image) and the schema of every setting."""
    rows = settings_metadata()
    categories = [
        {"title": category, "settings": [r["env"] for r in rows if r["category"] == category]}
        for category in CATEGORIES
    ]
    return {
        "versions": {
            version: {
                "imageName": f"{image}:{version}-cuda{cuda}",
                "minimumCudaVersion": cuda,
                "categories": [c for c in categories if c["settings"]],
            }
        },
        "schema": {row["env"]: _schema_entry(row) for row in rows},
    }


def render(form: dict[str, Any]) -> str:
    return json.dumps(form, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serverless_llm.worker.console_form",
        description="Print worker-config.json, the console's deploy form.",
    )
    ap.add_argument("--image", default=DEFAULT_IMAGE, help="image repository, without the tag")
    ap.add_argument("--version", default=__version__, help="release version (the tag's prefix)")
    ap.add_argument("--cuda", default=DEFAULT_CUDA, help="CUDA version of the image variant")
    ap.add_argument(
        "--check", metavar="FILE", help="exit 1 when FILE differs from what would be printed"
    )
    args = ap.parse_args(argv)
    text = render(console_form(args.image, args.version, args.cuda))
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(
                    f"{args.check} is stale: python -m serverless_llm.worker.console_form "
                    f"> {args.check}",
                    file=sys.stderr,
                )
                return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
