"""Checkpoint tensor relayout (FP8 dequantize, transpose, cast in one XLA fusion) against plain numpy."""

import ml_dtypes
import numpy as np
import pytest

from maxtext_moe.checkpoint.relayout import StoredTensor, relayout
from maxtext_moe.errors import UserError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _fp8_codes(shape, seed=0):
  """Every finite e4m3 code (all but the two NaNs), shuffled over `shape`."""
  codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
  return np.random.default_rng(seed).choice(codes, size=shape).view(ml_dtypes.float8_e4m3fn)


def _numpy_reference(q, scale_inv, block, transpose, dtype):
  s = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[: q.shape[0], : q.shape[1]]
  w = q.astype(np.float32) * s
  return np.ascontiguousarray((w.T if transpose else w).astype(dtype))


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_fp8_with_partial_scale_blocks_matches_numpy_bit_for_bit(transpose, dtype):
  q = _fp8_codes((200, 130))  # the docstring's example: blocks of 128 leave partial ones on both axes
  scale = np.random.default_rng(1).uniform(1e-4, 1e-1, size=(2, 2)).astype(np.float32)
  got = relayout(StoredTensor(q, scale, (128, 128)), dtype, transpose=transpose)
  want = _numpy_reference(q, scale, (128, 128), transpose, dtype)
  assert got.shape == ((130, 200) if transpose else (200, 130)) and got.dtype == dtype and got.flags.c_contiguous
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("shape", [(7, 5), (1, 9), (257, 3)])
def test_bf16_transpose_is_exact(shape):
  x = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7).astype(BF16)
  got = relayout(x, BF16, transpose=True)
  assert got.flags.c_contiguous
  np.testing.assert_array_equal(got.view(np.uint16), np.ascontiguousarray(x.T).view(np.uint16))


def test_result_never_shares_the_source_memory():
  x = np.ones((4, 3), BF16)
  for transpose in (False, True):
    got = relayout(x, BF16, transpose=transpose)
    assert not np.shares_memory(got, x)


def test_bad_scales_are_named():
  q = _fp8_codes((200, 130))
  with pytest.raises(UserError, match=r"weight_scale_inv has shape \[1, 2\], expected \[2, 2\] for \[200, 130\]"):
    relayout(StoredTensor(q, np.ones((1, 2), np.float32)), BF16)
  with pytest.raises(UserError, match="has no weight_scale_inv"):
    relayout(q, BF16)
