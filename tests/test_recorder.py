"""Run outputs: JSONL rows, resume truncation, summary and plot."""

import io
import json
import os
import stat
import warnings

import pytest

from maxtext_moe.runlog import report
from maxtext_moe.runlog.files import load_row, read_jsonl, step_row
from maxtext_moe.runlog.recorder import RunRecorder
from maxtext_moe.runlog.summary import summarize
from maxtext_moe.upstream.maxtext.recovery import NonFiniteGuard, NonFiniteLoss


def _scalars(loss, tokens=100.0):
  return {
    "learning/loss": loss,
    "perf/per_device_tokens_per_sec": tokens,
    "perf/per_device_tflops_per_sec": 0.5,
    "moe/tokens_dropped": 0.0,
    "learning/other": 1.0,
  }


def test_step_row_scales_tokens_by_devices_and_keeps_moe_metrics():
  row = step_row(3, _scalars(2.0, tokens=10.0), num_devices=8)
  assert row == {
    "step": 3,
    "loss": 2.0,
    "tflops_per_s_per_device": 0.5,
    "tokens_per_s": 80.0,
    "moe/tokens_dropped": 0.0,
  }


def test_resume_drops_rows_at_or_after_the_restored_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(6)))
  rec = RunRecorder(
    run_dir=tmp_path, total_steps=8, num_devices=1, progress="silent", plot_name="", stream=io.StringIO()
  )
  rec.start(None, start_step=4)
  rec.step(4, _scalars(1.5))
  rec.finish()
  rows = read_jsonl(path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  assert rows[-1]["loss"] == 1.5


@pytest.mark.parametrize("cut", [40, 2])
def test_a_line_cut_short_by_a_crash_is_set_aside_and_the_run_resumes(tmp_path, capfd, cut):
  """A node crash or a full disk mid-write leaves metrics.jsonl (and moe_load.jsonl) ending in part of a
  row: the resume keeps every whole row, sets the part aside in metrics.jsonl.torn with one warning line,
  and its next row starts on a line of its own; `report` reads the whole rows with the same warning."""
  from maxtext_moe.runlog.report import report

  rows = "".join(json.dumps({"step": s, "loss": 9.0 - s, "tokens_per_s": 10.0}) + "\n" for s in range(6))
  (tmp_path / "metrics.jsonl").write_text(rows[:-cut])
  load = "".join(json.dumps({"step": s, "load": [[1.0, 2.0]], "bias_abs_mean": [0.0]}) + "\n" for s in (0, 4))
  (tmp_path / "moe_load.jsonl").write_text(load[:-7])
  rec = RunRecorder(
    run_dir=tmp_path, total_steps=8, num_devices=1, progress="silent", plot_name="", stream=io.StringIO()
  )
  rec.start(None, start_step=5)
  rec.step(5, _scalars(1.5))
  rec.finish()
  err = capfd.readouterr().err
  assert "metrics.jsonl has 1 cut-short line(s) (line 6: a crash mid-write); kept in" in err, err
  assert (tmp_path / "metrics.jsonl.torn").read_text() == rows[:-cut].splitlines()[-1] + "\n"
  assert (tmp_path / "moe_load.jsonl.torn").is_file()
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
  assert "cut-short" not in capfd.readouterr().err, "the rewritten file is whole"
  # A torn last line, then an append (a run killed mid-write, then a report while another appends):
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 6, "lo')
  from maxtext_moe.runlog import files

  with files.open_append(tmp_path / "metrics.jsonl") as f:
    f.write(json.dumps({"step": 7, "loss": 1.0}) + "\n")
  report(tmp_path)
  assert "line 7: a crash mid-write" in capfd.readouterr().err
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 7]


def test_finish_writes_plot_and_summary(tmp_path):
  out = io.StringIO()
  rec = RunRecorder(run_dir=tmp_path / "run", total_steps=3, num_devices=2, progress="plain", stream=out)
  rec.start(None, start_step=0)
  for step, loss in enumerate((10.0, 8.0, 5.0)):
    rec.step(step, _scalars(loss, tokens=50.0 + step))
  summary = rec.finish()
  assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert summary["final_loss"] == 5.0 and summary["first_loss"] == 10.0
  assert summary["tokens_per_s"] == 2 * 51.5  # median of steps 2..3; the compiling first step is excluded
  text = out.getvalue()
  assert "step     3/3  loss 5.0000" in text and "50% lower" in text


def test_a_one_step_run_plots_without_a_warning(tmp_path):
  """Its three pictures and nothing on standard error: the load heatmap's one step was an x range of zero
  width ("Attempting to set identical low and high xlims", a matplotlib UserWarning)."""
  (tmp_path / "metrics.jsonl").write_text(json.dumps(step_row(0, _scalars(4.0), num_devices=1)) + "\n")
  row = load_row(0, [[3, 1, 0, 4], [2, 2, 2, 2]], [0.0, 0.01])
  (tmp_path / "moe_load.jsonl").write_text(json.dumps(row) + "\n")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, written = report.report(tmp_path)
  assert [str(w.message) for w in caught] == []
  assert written == [tmp_path / "loss.png", tmp_path / "moe_load.png", tmp_path / "moe_balance.png"]


def test_summarize_empty_run():
  assert summarize([]) == {"steps": 0, "steps_this_run": 0, "tokens_dropped": 0, "nonfinite_steps": 0}


def _recorder(tmp_path, **kw):
  return RunRecorder(
    run_dir=tmp_path, total_steps=8, num_devices=1, progress="silent", plot_name="", stream=io.StringIO(), **kw
  )


def test_metrics_file_follows_the_umask_like_the_other_run_files(tmp_path):
  rec = _recorder(tmp_path)
  rec.start(None, start_step=0)
  rec.finish()
  umask = os.umask(0)
  os.umask(umask)
  assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o666 & ~umask


def _observe(guard, rec, step, loss):
  """What the trainer hook does with a step: the policy's notes into the row, then its stop, if any."""
  notes, stop = guard.observe(step, loss)
  rec.step(step, _scalars(loss), notes)
  if stop is not None:
    raise stop


def test_a_nonfinite_loss_is_recorded_then_stops_or_is_skipped_until_the_limit(tmp_path):
  rec = _recorder(tmp_path)
  rec.start(None, start_step=0)
  guard = NonFiniteGuard()
  _observe(guard, rec, 0, 2.0)
  with pytest.raises(NonFiniteLoss) as e:
    _observe(guard, rec, 1, float("nan"))
  assert (e.value.step, e.value.kind, e.value.skipped) == (1, "nan", 0)
  rows = read_jsonl(tmp_path / "metrics.jsonl")  # valid JSON: no NaN token, and the row is written first
  assert rows[1] == {
    "step": 1,
    "loss": None,
    "loss_nonfinite": "nan",
    "tflops_per_s_per_device": 0.5,
    "tokens_per_s": 100.0,
    "moe/tokens_dropped": 0.0,
  }
  assert rec.finish()["nonfinite_steps"] == 1

  skip = _recorder(tmp_path / "skip")
  (tmp_path / "skip").mkdir()
  skip.start(None, start_step=0)
  guard = NonFiniteGuard(skip=True, max_skips=2)
  _observe(guard, skip, 0, float("inf"))
  _observe(guard, skip, 1, 3.0)  # a finite step resets the count
  _observe(guard, skip, 2, float("nan"))
  with pytest.raises(NonFiniteLoss) as e:
    _observe(guard, skip, 3, float("nan"))
  assert (e.value.step, e.value.kind, e.value.skipped) == (3, "nan", 3)
  assert [r.get("nonfinite_skipped", False) for r in skip.rows] == [True, False, True, True]
  assert summarize(skip.rows)["final_loss"] == 3.0
