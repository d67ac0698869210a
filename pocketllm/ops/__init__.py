"""Compute kernels the layers call: the gated delta rule (naive, chunked, device backends)."""
