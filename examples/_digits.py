"""The data of the Keras tutorial examples (``mnist_mirrored.py``, ``keras3_mnist.py``): images and pipelines.

``load_data`` reads MNIST in Keras' format (``--data mnist.npz``) or, by
default, the real handwritten digits scikit-learn ships (8x8 images);
``tutorial_datasets`` builds the tutorial's input pipelines over Dask arrays
persisted on the strategy's workers: ``map(scale).cache().shuffle().batch()``
for training, ``map(scale).batch()`` for evaluation.
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np

import daskdist as dd

BUFFER_SIZE = 10_000


def load_data(path: str | None) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], float]:
    """(train, test) images with a channel axis, integer labels, and the pixel maximum used to scale."""
    if path:
        with np.load(path) as f:
            train = (f["x_train"][..., None], f["y_train"].astype(np.int64))
            test = (f["x_test"][..., None], f["y_test"].astype(np.int64))
        return train, test, 255.0
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:]), 16.0


def tutorial_datasets(strategy: Any, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                      pixel_max: float, batch_size: int) -> tuple[dd.data.Dataset, dd.data.Dataset]:
    """The tutorial's training and evaluation pipelines over Dask arrays that stay on the workers."""
    chunk = max(1, len(train[1]) // (4 * strategy.num_replicas_in_sync))

    def on_cluster(array: np.ndarray) -> da.Array:
        return strategy.client.persist(da.from_array(array, chunks=(chunk,) + array.shape[1:]))

    def scale(image: Any, label: Any) -> tuple[Any, Any]:
        return (image / pixel_max).astype(np.float32), label

    train_dataset = (dd.data.Dataset.from_dask((on_cluster(train[0]), on_cluster(train[1])))
                     .map(scale).cache().shuffle(BUFFER_SIZE, seed=0).batch(batch_size))
    eval_dataset = (dd.data.Dataset.from_dask((on_cluster(test[0]), on_cluster(test[1])))
                    .map(scale).batch(batch_size))
    return train_dataset, eval_dataset
