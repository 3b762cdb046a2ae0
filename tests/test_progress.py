"""The progress bar: redrawn in place on a terminal, one line per update otherwise."""
import io

from torch_sparse_metal._progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(4, "job: ", stream=out)
    bar.update(1, "step 1")
    bar.update(2, "step 2")
    bar.close("done")
    assert out.getvalue() == "job: step 1\njob: step 2\njob: done\n"


def test_bar_redrawn_in_place_on_a_terminal():
    out = _Terminal()
    bar = ProgressBar(4, "job: ", stream=out, width=8)
    bar.update(1, "step 1")
    bar.update(4, "step 4")
    bar.close("done")
    text = out.getvalue()
    assert text.startswith("\rjob: [##------] step 1")
    assert "\rjob: [########] step 4" in text
    assert text.endswith("\njob: done\n") and text.count("\n") == 2
