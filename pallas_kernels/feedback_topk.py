"""Moved to ``pallas_kernels.error_feedback`` (MicroAdam's error feedback, one op module); importing this warns."""

import warnings

from pallas_kernels.error_feedback import feedback_topk, feedback_topk_reference

__all__ = ["feedback_topk", "feedback_topk_reference"]

warnings.warn("pallas_kernels.feedback_topk moved to pallas_kernels.error_feedback.", DeprecationWarning, stacklevel=2)
