"""Example models trained through rlx_tvm."""
