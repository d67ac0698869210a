"""Closeness the numeric tests share: the worst error relative to the reference's largest value,
so that one tolerance serves inputs of any scale."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (a zero reference counts as 1e-6)."""
    err = (actual.double() - expected.double()).abs().max().item()
    return err / max(expected.double().abs().max().item(), 1e-6)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"max abs err / max |ref| = {err:.3e} > {tol:.1e}"
