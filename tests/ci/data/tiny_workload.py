"""The smallest workload: what the action's CPU-fallback test runs through the real plugin."""

from __future__ import annotations

import torch


def get_model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to("cuda").eval()
    x = torch.randn(8, 64, device="cuda")
    return model, x
