"""`python -m tools.convert_ckpt`: the same converter as `megarl-convert` (see megarl/cli/convert.py)."""
