"""Run outputs: JSONL rows, resume truncation, summary and plot."""

import io
import json

from maxtext_moe.launch.recorder import RunRecorder, read_jsonl, step_row, summarize


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


def test_summarize_empty_run():
  assert summarize([], []) == {"steps_this_run": 0}
