"""Q2_0 packing of ternary weights, checked against ggml's documented bit layout."""

from __future__ import annotations

import numpy as np
import pytest

from ternary_serve import synthetic


def dequantize_q2_0(packed: np.ndarray, cols: int) -> np.ndarray:
    """ggml's dequantize_row_q2_0: per 18-byte block, fp16 d then 2-bit codes, 00=-1 .. 10=+1."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, cols // 64, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 2:]
    codes = np.stack([(qs >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1).reshape(rows, -1, 64)
    return ((codes.astype(np.float32) - 1) * d).reshape(rows, cols)


def test_ternary_weights_round_trip_exactly():
    rng = np.random.default_rng(1)
    weights = synthetic.ternary_matrix(rng, 8, 256)
    packed = synthetic.pack_q2_0(weights)
    assert packed.shape == (8, 256 // 64 * 18)
    np.testing.assert_array_equal(dequantize_q2_0(packed, 256), weights)


def test_all_zero_group_packs_to_zero_scale():
    packed = synthetic.pack_q2_0(np.zeros((1, 64), dtype=np.float32))
    np.testing.assert_array_equal(dequantize_q2_0(packed, 64), 0)


def test_rows_must_be_whole_groups():
    with pytest.raises(ValueError, match="multiple of 64"):
        synthetic.pack_q2_0(np.zeros((1, 100), dtype=np.float32))


def test_27b_profile_is_27b_class():
    params = synthetic.PROFILES["27b"].linear_params()
    assert 26e9 < params < 28e9
