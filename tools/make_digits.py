"""Regenerate ``cgdp/data/digits.npz`` from scikit-learn's bundled copy of the UCI optical digits.

Run once by a maintainer (``python tools/make_digits.py``); scikit-learn is needed only here, never
at run time. The file holds uint8 images (values 0..16, shape N x 8 x 8) and uint8 labels, split
into a fixed train/test partition: a permutation drawn with seed 0, the last 20 % (360 samples) as
the test set. The output is byte-for-byte reproducible (compressed ``.npz`` without timestamps
that matter: NumPy writes fixed zip dates).
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "cgdp" / "data" / "digits.npz"
TEST_SIZE = 360


def main() -> int:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("scikit-learn is needed to regenerate the dataset: pip install scikit-learn", file=sys.stderr)
        return 2
    d = load_digits()
    images = d.images.astype(np.uint8)  # values are integers 0..16 stored as float64
    assert np.array_equal(images, d.images), "expected integer pixel counts 0..16"
    labels = d.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:-TEST_SIZE], order[-TEST_SIZE:]
    np.savez_compressed(OUT, x_train=images[train], y_train=labels[train],
                        x_test=images[test], y_test=labels[test])
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {len(train)} train, {len(test)} test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
