"""What a caller passes a built-in model, checked: the weights, the rows, their sample
weights. Each error names the model (its ``repr``) and what it expected."""

from __future__ import annotations

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.base import is_sparse_matrix


def checked_weights(model, weights) -> np.ndarray:
    """``weights`` as a contiguous float32 vector of ``model.size`` parameters."""
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if weights.shape != (model.size,):
        raise InputError(
            f"{model!r}: weights must be a flat vector of {model.size} parameters, "
            f"got shape {weights.shape}"
        )
    return weights


def checked_sample_weight(model, sample_weight, rows: int) -> np.ndarray | None:
    """``sample_weight`` as float64, one finite weight >= 0 per row; None stays None."""
    if sample_weight is None:
        return None
    weight = np.asarray(sample_weight, dtype=np.float64)
    if weight.shape != (rows,):
        raise InputError(
            f"{model!r}: sample_weight has shape {weight.shape}; it needs one weight per row of "
            f"X, shape ({rows},)"
        )
    if not (np.isfinite(weight).all() and (weight >= 0).all()):
        raise InputError(
            f"{model!r}: sample_weight holds a negative, NaN or infinite weight; each must be a "
            "finite number >= 0"
        )
    return weight


def checked_features(model, X) -> np.ndarray:
    """``X`` as float32 rows of ``model.n_features`` columns: a CSR matrix stays one (as
    float32), anything else becomes a 2-D array; no rows at all may come as an empty 1-D."""
    if is_sparse_matrix(X):
        X = X.tocsr()
        if X.dtype != np.float32:
            X = X.astype(np.float32)
        if X.shape[1] != model.n_features:
            raise InputError(f"{model!r}: X has {X.shape[1]} features, expected {model.n_features}")
        return X
    X = np.asarray(X, dtype=np.float32)
    if X.ndim == 1 and X.size == 0:
        return X.reshape(0, model.n_features)
    if X.ndim != 2:
        raise InputError(f"{model!r}: X must be 2-D (rows, features), got shape {X.shape}")
    if X.shape[1] != model.n_features:
        raise InputError(f"{model!r}: X has {X.shape[1]} features, expected {model.n_features}")
    return X
