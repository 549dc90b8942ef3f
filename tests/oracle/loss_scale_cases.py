"""Overflow patterns and fp16 settings for the loss-scale comparison with DeepSpeed's
DynamicLossScaler (recorded by ``deepspeed_loss_scale.py``, replayed by
tests/optim/test_precision.py)."""

PATTERN = [0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]

CASES = {
    "default_hysteresis": {"initial_scale_power": 6, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 1},
    "no_hysteresis": {"initial_scale_power": 6, "loss_scale_window": 4, "hysteresis": 1, "min_loss_scale": 1},
    "consecutive": {"initial_scale_power": 5, "loss_scale_window": 2, "hysteresis": 2,
                    "consecutive_hysteresis": True, "min_loss_scale": 2},
}
