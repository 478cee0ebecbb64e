"""The statistics' maths: the spread a report gives of a table's log energy per lookup."""

from __future__ import annotations

import math

import pytest
import torch

from probes.embeddings.maths import log_spread


def test_noise_spread_is_the_standard_deviation_of_the_log_energy_that_outliers_do_not_move() -> None:
    """noise_spread reads as a standard deviation of ln(energy per lookup): 0.5 for log-normal energies of
    sigma 0.5, whatever their scale, and still 0.5 with 3% of the rows (zombies) at 20x the median; that of
    the rows above the median where the rows below spread wider (a table memorising its quiet rows); NaN
    without a positive median."""
    gen = torch.Generator().manual_seed(0)
    occ = 3.0 * torch.exp(0.5 * torch.randn(4000, generator=gen))
    every = torch.ones(4000, dtype=torch.bool)

    def spread(x: torch.Tensor, eligible: torch.Tensor = every) -> float:
        median = torch.where(eligible, x, torch.full_like(x, float("nan"))).nanmedian()
        return float(log_spread(x, eligible, median))

    assert spread(occ) == pytest.approx(0.5, abs=0.03)
    zombies = occ.clone()
    zombies[:120] = 20 * occ.median()
    assert spread(zombies) == pytest.approx(0.5, abs=0.05)
    assert spread(occ, torch.arange(4000) < 2000) == pytest.approx(0.5, abs=0.04)  # eligible rows only
    quiet = torch.where(occ < occ.median(), occ.median() * (occ / occ.median()) ** 3, occ)  # sigma 1.5 below
    assert spread(quiet) == pytest.approx(0.5, abs=0.03)  # the side a zombie is looked for on
    assert math.isnan(spread(torch.zeros(10), torch.ones(10, dtype=torch.bool)))
