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


@pytest.mark.extended
def test_bounded_ep_measurement_on_a_small_shape(monkeypatch):
  """`bench moe`'s bounded-memory rows on a shape small enough for a test: less XLA temporary memory than
  the worst-case buffers, one round for natural routing, more for every token on one rank, nothing dropped.
  (The figures themselves come from `bench moe`, at SHAPE.)"""
  from maxtext_moe.bench import bounded_ep

  monkeypatch.setattr(
    bounded_ep, "SHAPE", {"ep": 8, "tokens": 2048, "dim": 256, "hidden": 8, "experts": 16, "top_k": 2}
  )
  got = bounded_ep._in_process(timed=False)
  assert got["bounded_memory_ratio"] < 0.5, got
  assert got["natural_bounded_rounds"] == 1 and got["adversarial_rounds"] > 1, got
  assert got["natural_bounded_dropped"] == got["one_rank_bounded_dropped"] == 0


@pytest.mark.extended
def test_timemodel_prints_every_published_point_beside_its_prediction(capsys):
  """`bench timemodel --quick`: the three published points, each ratio predicted / published, and every
  constant with its source in the JSON."""
  from maxtext_moe.bench import timemodel

  result = timemodel.run(out=__import__("sys").stdout, as_json=True, quick=True)
  points = {r["point"]: r for r in result["published"]}
  assert len(points) == 3 and all(
    r["ratio"] == pytest.approx(r["predicted"] / r["published"], abs=1e-3) for r in points.values()
  )
  assert all(c["source"] for c in result["constants"].values())
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
