"""An offline text corpus: this Python's standard-library sources, written once as a parquet file.

Every machine that runs maxtext-moe has a Python, so its stdlib is real text (code, docstrings,
comments) that needs no network. MaxText's grain pipeline reads the parquet's `text` column and
tokenizes it with the recipe's tokenizer.
"""

import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# 8 MB of source is ~2.5M llama2 tokens: ~1,200 steps of the default 8 x 256 batch before an epoch ends.
DEFAULT_MAX_CHARS = 8_000_000


CACHE_ENV = "MAXTEXT_MOE_CACHE"  # where the corpus and staged JSONL go (default ~/.cache/maxtext_moe)


def cache_dir() -> Path:
  return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "maxtext_moe"))


def stdlib_files(root: Path | None = None) -> list[Path]:
  """Sorted stdlib `.py` files, without tests and site-packages, so the corpus is deterministic."""
  root = root or Path(sysconfig.get_paths()["stdlib"])
  skip = {"test", "tests", "site-packages", "idlelib", "__pycache__"}
  return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def python_stdlib_parquet(*, max_chars: int = DEFAULT_MAX_CHARS) -> Path:
  """Returns the cached corpus parquet, building it atomically (temp file + rename) on first use."""
  ver = f"{sys.version_info.major}.{sys.version_info.minor}"
  out = cache_dir() / f"python{ver}-stdlib-{max_chars}.parquet"
  if out.is_file():
    return out
  texts, total = [], 0
  for path in stdlib_files():
    text = path.read_text(encoding="utf-8", errors="replace")
    texts.append(text)
    total += len(text)
    if total >= max_chars:
      break
  if not texts:
    raise FileNotFoundError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".parquet.tmp")
  os.close(fd)
  try:
    pq.write_table(pa.table({"text": texts}), tmp)
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


CORPORA = {"python_stdlib": python_stdlib_parquet}


def corpus_path(name: str) -> Path:
  """The parquet for a named corpus (`${moe_corpus:NAME}` in YAML)."""
  from maxtext_moe.errors import UserError

  if name not in CORPORA:
    raise UserError(f"unknown corpus '{name}'; known: {', '.join(CORPORA)}")
  return CORPORA[name]()
