"""Step progress lines carry the step, the metrics, the rate and the ETA."""

import io

from rich.console import Console

from posttrain.utils.progress import StepProgress, format_duration


def test_format_duration():
    assert format_duration(3725) == "1:02:05"
    assert format_duration(-3) == "0:00:00"


def test_non_interactive_progress_prints_one_line_per_step_with_rate_and_eta():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=200)
    with StepProgress("sft", total=4, start=2, console=console) as progress:
        progress.advance(3, {"loss": 0.5})
        progress.advance(4, {"loss": 0.25})
    lines = buffer.getvalue().strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("sft step 3/4  loss 0.5") and "steps/s" in lines[0] and "ETA" in lines[0]
    assert lines[1].startswith("sft step 4/4  loss 0.25") and lines[1].endswith("ETA 0:00:00")
