"""`dlcore ops OP`: one op in full, what a caller passes and what a second implementation must accept."""

from dlcore.cli import main


def test_ops_op_shows_arguments_layouts_example_sizes_and_spaces(capsys):
    assert main(["ops", "rms_norm"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "tensor" in rows["x"] and "contiguous,rows" in rows["x"] and "bucket rows" in rows["x"]
    assert "float16,bfloat16,float32" in rows["weight"]
    assert "scalar" in rows["eps"] and "default 1e-06" in rows["eps"]
    assert "example sizes (--shape): tokens=37, hidden=256" in out
    assert "BLOCK_N: a power of two in" in rows["triton"] and "-" in rows["reference"]
