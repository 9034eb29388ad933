"""How every benchmark ends: its table, and with --json one JSON object, on the right streams.

Standard output carries only what was asked for: the table, or with --json the JSON object alone (the
table then goes to standard error, for the person watching)."""

import json
import sys
from typing import IO, Any


def emit(table: Any, result: dict[str, Any], *, as_json: bool, out: IO[str], width: int = 110) -> None:
  """Prints a rich `table` and, with `as_json`, `result` as one JSON line."""
  from rich.console import Console  # pylint: disable=import-outside-toplevel

  Console(file=sys.stderr if as_json else out, width=width).print(table)
  if as_json:
    print(json.dumps(result), file=out, flush=True)
