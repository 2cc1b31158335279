"""Models written as ordinary PyTorch, for `nnscaler import torch` (test/tools/import-torch.test)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, labels):
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h
        return F.cross_entropy(self.head(h), labels)


class Block(nn.Module):
    """An embedding, a layer norm, a bias-free projection with a transpose and a matrix
    product, a softmax, reshapes: the shape-changing ops the importer maps."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.ln = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 11)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.ln(self.emb(idx))
        q = self.q(x)
        att = torch.softmax(q @ x.transpose(1, 2), dim=-1)
        y = (att @ x).reshape(b * t, 16)
        logits = self.out(F.relu(y)).view(b, t, 11)
        return F.cross_entropy(logits.view(b * t, 11), targets.view(b * t))


def mlp():
    return MLP()


def block():
    return Block()


def unsupported():
    class Cumsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cumsum(self.w(x), 0).sum()

    return Cumsum()
