"""Learning-rate schedule: warm-up ramps up, cosine decays to min_ratio at the last step."""

import pytest

from titanrl.trainer.lr_schedule import lr_multiplier


def test_warmup_then_constant():
    """Warm-up rises strictly to 1 and constant stays at 1 afterwards."""
    ramp = [lr_multiplier(s, 100, 4, "constant", 0.1) for s in range(4)]
    assert ramp == sorted(ramp) and ramp[0] > 0 and ramp[-1] < 1
    assert all(lr_multiplier(s, 100, 4, "constant", 0.1) == 1.0 for s in range(4, 100))


def test_cosine_reaches_min_ratio_at_the_end():
    """Cosine starts at 1 after warm-up, halves midway, ends at min_ratio and never goes below it."""
    assert lr_multiplier(10, 110, 10, "cosine", 0.2) == pytest.approx(1.0)
    assert lr_multiplier(60, 110, 10, "cosine", 0.2) == pytest.approx(0.6)
    assert lr_multiplier(110, 110, 10, "cosine", 0.2) == pytest.approx(0.2)
    assert lr_multiplier(500, 110, 10, "cosine", 0.2) == pytest.approx(0.2)


def test_unknown_decay_is_an_error():
    with pytest.raises(ValueError, match="cosine"):
        lr_multiplier(5, 10, 0, "linear", 0.1)
