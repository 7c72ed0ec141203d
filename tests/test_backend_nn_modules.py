"""PyTorch's own building blocks through backend="torch_ext", as a model library we did not write would use
them: convolutions with BatchNorm in training (running statistics are buffers written in place), a
stacked LSTM (one cuDNN-style op on GPU, a decomposition here), and nn.TransformerEncoder (its fused
fast path in eval). Outputs, parameter gradients and buffers equal eager's over a few steps, with an
SGD step between them, in training and in eval."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def conv_bn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4)), torch.randn(4, 3, 12, 12)


class LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, (h, _) = self.rnn(x)
        return self.head(out[:, -1]), h


def lstm():
    return LastStep(), torch.randn(3, 5, 8)


def transformer():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(2, 6, 16)


def _tensors(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("make", [conv_bn, lstm, transformer])
def test_builtin_modules_match_eager_with_their_buffers_over_steps(make, train):
    torch.manual_seed(0)
    model, x = make()
    model.train(train)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="torch_ext")
    for step in range(3):
        expected, actual = model(x + step), compiled(x + step)
        torch.testing.assert_close(_tensors(actual), _tensors(expected), atol=1e-5, rtol=1e-4)
        if train:
            sum(t.sum() for t in _tensors(expected)).backward()
            sum(t.sum() for t in _tensors(actual)).backward()
            with torch.no_grad():
                for p, q in zip(model.parameters(), compiled_model.parameters()):
                    torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4)
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                    p.grad = q.grad = None
        torch.testing.assert_close(dict(compiled_model.named_buffers()), dict(model.named_buffers()))
    if train and make is conv_bn:  # the running statistics moved: the buffers' writes were kept
        assert model[1].num_batches_tracked.item() == 3
