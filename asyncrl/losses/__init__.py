"""Losses, advantage estimators and importance-sampling diagnostics.

The contract lives in :mod:`asyncrl.losses.base`; the built-ins (one module each) are
built from config with ``_target_`` exactly like a user's loss class.
"""

from asyncrl.losses.base import Loss, LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum

__all__ = ["Loss", "LossBatch", "LossOutput", "ModelOutputs", "masked_mean", "weighted_sum"]
