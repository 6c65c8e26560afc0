"""The model fingerprint names a model exactly: any changed stored bit changes it."""

from __future__ import annotations

import copy

import torch
from torch import nn

from stalwart.fingerprint import model_hash


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()


def test_same_state_same_hash_and_any_flipped_bit_changes_it() -> None:
    m = _model()
    h = model_hash(m)
    assert len(h) == 16 and model_hash(copy.deepcopy(m)) == h
    w = m[0].weight.data.view(-1).view(torch.int32)
    w[5] ^= 1  # the lowest mantissa bit of one weight
    assert model_hash(m) != h
    w[5] ^= 1
    assert model_hash(m) == h
    m[1].num_batches_tracked += 1  # buffers count too
    assert model_hash(m) != h


def test_dtype_and_quantized_words_are_part_of_the_identity() -> None:
    m = _model()
    assert model_hash(copy.deepcopy(m).double()) != model_hash(m)
    q = torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
    h = model_hash(q)
    assert model_hash(copy.deepcopy(q)) == h
    q2 = torch.ao.quantization.quantize_dynamic(_model(), {nn.Linear}, dtype=torch.qint8)
    assert model_hash(q2) == h
    q2[2].set_weight_bias(q2[2].weight(), q2[2].bias() + 1)
    assert model_hash(q2) != h
