import rlx_tvm  # noqa: F401  (registers the ops and gradients once per test process)
