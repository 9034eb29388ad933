"""The benchmark's dedup row: the real all_to_all dispatcher at EP=8 against the analytic expectation."""

import pytest

from maxtext_moe.bench.moe_speed import _dedup_in_process
from maxtext_moe.cli import build_parser


def test_measured_dedup_matches_the_analytic_expectation():
  got = _dedup_in_process()  # conftest gives this process 8 fake devices
  assert got["dropped"] == 0
  assert got["measured"] == pytest.approx(got["expected"], rel=0.01), got
  assert got["measured"] < 1.0


def test_bench_cli_parses():
  ns = build_parser().parse_args(["bench", "moe", "--json", "--backends", "tiled"])
  assert (ns.which, ns.json, ns.backends) == ("moe", True, ["tiled"])
