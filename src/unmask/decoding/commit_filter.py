"""A learned commit rule: a logistic filter over a few per-position statistics that predicts whether a masked
position's current proposal is the token the model would end up committing there one token per forward.

A fixed confidence threshold treats every position alike; but a proposal right after the committed prefix
with p = 0.6 is usually final, while one at the far end of the block with p = 0.9 often is not. Learn2PD
(arXiv 2509.25188) trains a tiny filter on the model's own decoding to make that call; this is the same idea
with five features and a logistic regression (6 parameters), fitted in seconds on the model's trajectories
(`unmask.train.calibrate`) and stored in the model's `generation_config.json` under `commit_filter`.

The "learned" policy then commits every row whose predicted probability of being final is at least the
request's `threshold`, and always the row most likely to be final, so every step progresses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# masked_share: the block's masks now over its masks when it started
FEATURES = ("logit_confidence", "margin", "entropy", "log_distance", "masked_share")
CONFIG_KEY = "commit_filter"


def feature_matrix(probs: Tensor, margin: Tensor, entropy: Tensor, distance: Tensor, masked_share: Tensor) -> Tensor:
    """[M, F] float32, the columns in FEATURES order (all inputs [M])."""
    p = probs.float().clamp(1e-6, 1 - 1e-6)
    return torch.stack([torch.log(p / (1 - p)), margin.float(), entropy.float(), torch.log1p(distance.float()),
                        masked_share.float()], dim=1)


def features(probs: Tensor, margin: Tensor, entropy: Tensor, offsets: Tensor, initial_masked: int) -> Tensor:
    """Features of the masked rows of one block: probs / margin / entropy are the proposal's p(x0), p1 - p2 and
    entropy (all [M]); offsets their positions within the block ([M] long); initial_masked the block's masks when
    it started. Distance counts from the leftmost masked row, the position a one-token-per-forward decoder of a
    left-to-right-trained model fills next."""
    dist = offsets - offsets.min() if offsets.numel() else offsets
    share = torch.full_like(probs, offsets.numel() / max(initial_masked, 1), dtype=torch.float32)
    return feature_matrix(probs, margin, entropy, dist, share)


@dataclass(frozen=True)
class CommitFilter:
    weights: tuple[float, ...]
    bias: float

    def __post_init__(self):
        if len(self.weights) != len(FEATURES):
            raise ValueError(f"commit_filter needs {len(FEATURES)} weights ({', '.join(FEATURES)}), "
                             f"got {len(self.weights)}")
        if not all(math.isfinite(w) for w in (*self.weights, self.bias)):
            raise ValueError("commit_filter weights must be finite numbers")

    def prob(self, feats: Tensor) -> Tensor:
        w = torch.tensor(self.weights, dtype=torch.float32, device=feats.device)
        return torch.sigmoid(feats @ w + self.bias)

    def to_json(self) -> dict:
        return {"features": list(FEATURES), "weights": list(self.weights), "bias": self.bias}

    @classmethod
    def from_json(cls, obj: object) -> "CommitFilter":
        if not isinstance(obj, dict) or obj.get("features") != list(FEATURES):
            raise ValueError(f"{CONFIG_KEY} must name the features {list(FEATURES)}")
        try:
            return cls(tuple(float(w) for w in obj["weights"]), float(obj["bias"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{CONFIG_KEY}: {e}") from None


def commit_rows(flt: CommitFilter, feats: Tensor, threshold: float) -> Tensor:
    """Bool [M]: rows predicted final with probability >= threshold, plus the most likely one."""
    p = flt.prob(feats)
    commit = p >= threshold
    commit[p.argmax()] = True
    return commit


def fit(feats: Tensor, final: Tensor, l2: float = 1e-3, iters: int = 200) -> tuple[CommitFilter, dict]:
    """Logistic regression of `final` ([N] bool) on `feats` ([N, F]) by L-BFGS; returns the filter and its fit
    statistics (log loss, accuracy, base rate) on the data it was fitted to."""
    x, y = feats.double(), final.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std  # standardised for the optimiser; folded back into the weights below
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        weights = w / std
        bias = b - (mean / std * w).sum()
        logits = x @ weights + bias
        stats = {"rows": int(y.numel()), "base_rate": float(y.mean()),
                 "log_loss": float(torch.nn.functional.binary_cross_entropy_with_logits(logits, y)),
                 "accuracy": float(((logits > 0).double() == y).double().mean())}
    return CommitFilter(tuple(float(v) for v in weights), float(bias)), stats
