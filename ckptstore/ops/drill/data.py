"""The frozen data snapshot of the drill: a synthetic receipt-classification set.

Generated deterministically from a seed (no download), with a content digest,
a fixed train/eval split, and a feature contract naming the features.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

CLASSES = ("grocery", "fuel", "restaurant", "pharmacy", "hardware", "other")
FEATURES_V4 = (
    "total_log", "n_items", "tax_rate", "hour_sin", "hour_cos", "weekday_sin", "weekday_cos", "has_fuel_kw",
    "has_food_kw", "has_rx_kw", "has_tool_kw", "card_payment", "tip_ratio", "discount_ratio", "avg_item_log",
    "max_item_log",
) + tuple(f"text_emb_{i:02d}" for i in range(16))


@dataclass(frozen=True)
class Snapshot:
    features: np.ndarray  # float32 [n, d]
    labels: np.ndarray  # int64 [n]
    sample_ids: np.ndarray  # int64 [n]
    train_idx: np.ndarray
    eval_idx: np.ndarray
    feature_contract: str
    data_digest: str
    split_digest: str


def make_snapshot(n: int = 4096, *, seed: int = 47, contract: str = "receipt-v4", eval_fraction: float = 0.2) -> Snapshot:
    rng = np.random.default_rng(seed)
    d = len(FEATURES_V4)
    centroids = rng.normal(0, 1.0, size=(len(CLASSES), d)).astype(np.float32)
    labels = rng.integers(0, len(CLASSES), size=n).astype(np.int64)
    noise = rng.normal(0, 1.3, size=(n, d)).astype(np.float32)
    features = (centroids[labels] + noise).astype(np.float32)
    ids = np.arange(100_000, 100_000 + n, dtype=np.int64)
    perm = np.random.default_rng(seed + 1).permutation(n)
    n_eval = int(n * eval_fraction)
    eval_idx, train_idx = np.sort(perm[:n_eval]), np.sort(perm[n_eval:])
    h = blake3.blake3()
    for a in (features, labels, ids):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(contract.encode())
    hs = blake3.blake3(train_idx.tobytes() + b"|" + eval_idx.tobytes())
    return Snapshot(
        features, labels, ids, train_idx, eval_idx, contract, "blake3:" + h.hexdigest()[:32], "blake3:" + hs.hexdigest()[:32]
    )
