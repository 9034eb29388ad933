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
  """`bench timemodel --quick`: the sixteen published points, each ratio predicted / published with its three
  largest costs, the count inside the target, and every constant with its source in the JSON."""
  from maxtext_moe.bench import timemodel

  result = timemodel.run(out=__import__("sys").stdout, as_json=True, quick=True)
  points = {r["point"]: r for r in result["published"]}
  assert len(points) == 16 and all(
    r["ratio"] == pytest.approx(r["predicted"] / r["published"], abs=1e-3) for r in points.values()
  )
  lo, hi = result["target"]
  assert result["within_target"] == sum(lo <= r["ratio"] <= hi for r in points.values())
  assert all(len(r["largest_s"]) == 3 for r in points.values())
  assert all(c["source"] for c in result["constants"].values())
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")


@pytest.mark.extended
def test_bench_flags_compiles_a_profile_and_reads_its_schedule(capsys):
  """`bench flags` for one case: the H200 profile's flags are all in the compiled step's report, and its
  schedule shows what the profile asks for (async collectives, no command buffer: off on Hopper)."""
  from maxtext_moe.bench import flag_profiles
  from maxtext_moe.config import flags

  result = flag_profiles.run(out=__import__("sys").stdout, as_json=True, only="h200, its profile")
  (case,) = result["cases"].values()
  assert case["xla_flags"] == flags.profile("h200").xla_flags
  assert case["async_starts"] and case["command_buffers"] == 0
  assert case["host_syncs_per_step"] == 6  # the rounds' conditional: 3 passes x 2 MoE layers
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")


def test_bench_flags_and_plan_refuse_an_unknown_case():
  from maxtext_moe.bench import flag_profiles, plan_accuracy
  from maxtext_moe.errors import UserError

  with pytest.raises(UserError, match="no bench flags case contains 'nothing'"):
    flag_profiles.run(out=__import__("sys").stdout, only="nothing")
  with pytest.raises(UserError, match="no --gpu case contains 'nothing'"):
    plan_accuracy.run_gpu(out=__import__("sys").stdout, only="nothing")
