"""Experts: E two-layer MLPs, stored stacked so that one grouped GEMM serves them all.

Layout (so weights copy to and from other libraries): w1 [E, d, f], b1 [E, f], w2 [E, f, d],
b2 [E, d]; expert e computes act(x @ w1[e] + b1[e]) @ w2[e] + b2[e].
"""
import math

import torch
from torch import nn

from kernels import grouped_mlp


class Experts(nn.Module):
    def __init__(self, num_experts, model_dim, ffn_dim, activation="relu", activation_dropout=0.0):
        super().__init__()
        E, d, f = num_experts, model_dim, ffn_dim
        self.activation = activation
        self.activation_dropout = activation_dropout
        self.w1 = nn.Parameter(torch.empty(E, d, f))
        self.b1 = nn.Parameter(torch.empty(E, f))
        self.w2 = nn.Parameter(torch.empty(E, f, d))
        self.b2 = nn.Parameter(torch.empty(E, d))
        self.reset_parameters()

    def reset_parameters(self):
        # Each expert starts like a fresh nn.Linear pair (the dense FFN of fairseq's transformer).
        d, f = self.w1.shape[1], self.w1.shape[2]
        for w, b, fan_in in ((self.w1, self.b1, d), (self.w2, self.b2, f)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    @property
    def num_experts(self):
        return self.w1.shape[0]

    def forward(self, x, counts):  # x: [N, d] sorted by expert, counts: [E] -> [N, d]
        p = self.activation_dropout if self.training else 0.0
        return grouped_mlp(x, counts, self.w1, self.b1, self.w2, self.b2, self.activation, p)
