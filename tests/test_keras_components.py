"""Numerical building blocks of daskdist.keras: layers, activations, losses, optimizers, metrics.

Backward passes are checked against central differences in float64;
convolution and pooling against naive loop implementations; synchronised
BatchNormalization with replicas as threads sharing an all-reduce.
"""

from __future__ import annotations

import json
import math
import pickle
import threading

import numpy as np
import pytest

from daskdist.keras import activations, backend, initializers, layers, losses, metrics, optimizers

from .fakes import InMemoryGroup

F64 = "float64"


# ---------------------------------------------------------------------------------------------------------
# helpers


def numeric_grad(f, arr: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central-difference gradient of the scalar ``f()`` with respect to ``arr`` (perturbed in place)."""
    grad = np.zeros_like(arr, dtype=np.float64)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + eps
        fp = f()
        arr[idx] = old - eps
        fm = f()
        arr[idx] = old
        grad[idx] = (fp - fm) / (2 * eps)
    return grad


def check_layer_gradients(layer: layers.Layer, x: np.ndarray, training: bool = True, seed: int = 0,
                          atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Compare ``backward`` (input and param grads) with central differences of ``sum(forward(x) * r)``."""
    rng = np.random.default_rng(seed)
    if not layer.built:
        layer.build(x.shape[1:], rng=rng)
    y = layer.forward(x, training=training)
    r = rng.standard_normal(y.shape)
    grad_x = layer.backward(r)
    grads = {k: v.copy() for k, v in layer.grads.items()}
    assert set(grads) == set(layer.params)

    def f() -> float:
        return float((layer.forward(x, training=training) * r).sum())

    np.testing.assert_allclose(grad_x, numeric_grad(f, x), atol=atol, rtol=rtol, err_msg="input gradient")
    for key, param in layer.params.items():
        np.testing.assert_allclose(grads[key], numeric_grad(f, param), atol=atol, rtol=rtol, err_msg=key)


def distinct(rng: np.random.Generator, shape: tuple[int, ...], gap: float = 0.1) -> np.ndarray:
    """Random values that differ pairwise by at least ``gap`` (no ties for max pooling)."""
    return rng.permutation(math.prod(shape)).reshape(shape) * gap - 0.05 * math.prod(shape) * gap


def away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal-ish values with |x| >= 0.05 (ReLU kinks are never within a finite-difference step)."""
    x = rng.standard_normal(shape)
    return np.sign(x) * (np.abs(x) + 0.05)


def naive_conv2d(x, kernel, bias, strides, padding):
    """Direct convolution with TensorFlow's padding rules, one output pixel at a time."""
    n, h, w, c = x.shape
    kh, kw, _, f = kernel.shape
    sh, sw = strides
    if padding == "same":
        oh, ow = -(-h // sh), -(-w // sw)
        ph = max((oh - 1) * sh + kh - h, 0)
        pw = max((ow - 1) * sw + kw - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    out = np.zeros((n, oh, ow, f))
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                patch = x[b, i * sh:i * sh + kh, j * sw:j * sw + kw, :]
                out[b, i, j] = np.tensordot(patch, kernel, axes=3) + bias
    return out


def naive_maxpool(x, pool, strides, padding):
    n, h, w, c = x.shape
    ph, pw = pool
    sh, sw = strides
    if padding == "same":
        oh, ow = -(-h // sh), -(-w // sw)
        th = max((oh - 1) * sh + ph - h, 0)
        tw = max((ow - 1) * sw + pw - w, 0)
        x = np.pad(x, ((0, 0), (th // 2, th - th // 2), (tw // 2, tw - tw // 2), (0, 0)), constant_values=-np.inf)
    else:
        oh, ow = (h - ph) // sh + 1, (w - pw) // sw + 1
    out = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            out[:, i, j, :] = x[:, i * sh:i * sh + ph, j * sw:j * sw + pw, :].max(axis=(1, 2))
    return out


# ---------------------------------------------------------------------------------------------------------
# layers: gradients


@pytest.mark.parametrize("activation", [None, "relu", "sigmoid", "tanh", "softmax"])
def test_dense_gradients(activation):
    rng = np.random.default_rng(1)
    layer = layers.Dense(4, activation=activation, dtype=F64)
    x = away_from_zero(rng, (5, 3))
    layer.build((3,), rng=rng)
    layer.params["bias"][:] = rng.standard_normal(4) * 0.1
    z = x @ layer.params["kernel"] + layer.params["bias"]
    assert np.abs(z).min() > 1e-4  # no pre-activation within a finite-difference step of ReLU's kink
    check_layer_gradients(layer, x)


def test_dense_on_rank3_input_and_without_bias():
    rng = np.random.default_rng(2)
    layer = layers.Dense(3, use_bias=False, dtype=F64)
    check_layer_gradients(layer, rng.standard_normal((2, 4, 5)))
    assert set(layer.params) == {"kernel"}
    assert layer.compute_output_shape((4, 5)) == (4, 3)


@pytest.mark.parametrize(
    "kernel_size,strides,padding",
    [(3, 1, "valid"), (3, 1, "same"), (3, 2, "same"), ((2, 3), (2, 1), "valid"), (2, 2, "same"), (1, 1, "valid")],
)
def test_conv2d_gradients(kernel_size, strides, padding):
    rng = np.random.default_rng(3)
    layer = layers.Conv2D(3, kernel_size, strides=strides, padding=padding, dtype=F64)
    layer.build((5, 6, 2), rng=rng)
    layer.params["bias"][:] = rng.standard_normal(3) * 0.1
    check_layer_gradients(layer, rng.standard_normal((2, 5, 6, 2)))


def test_conv2d_gradients_with_relu():
    rng = np.random.default_rng(4)
    layer = layers.Conv2D(2, 3, padding="same", activation="relu", dtype=F64)
    layer.build((4, 4, 2), rng=rng)
    x = rng.standard_normal((2, 4, 4, 2))
    pre = naive_conv2d(x, layer.params["kernel"], layer.params["bias"], (1, 1), "same")
    assert np.abs(pre).min() > 1e-4  # no pre-activation within a finite-difference step of ReLU's kink
    check_layer_gradients(layer, x)


@pytest.mark.parametrize(
    "pool_size,strides,padding,shape",
    [(2, None, "valid", (2, 4, 6, 3)), (2, None, "valid", (2, 5, 5, 2)), (3, 2, "same", (2, 5, 6, 2)),
     ((2, 3), 1, "valid", (1, 4, 5, 2)), (2, None, "same", (2, 5, 3, 1))],
)
def test_maxpooling_gradients_and_reference(pool_size, strides, padding, shape):
    rng = np.random.default_rng(5)
    layer = layers.MaxPooling2D(pool_size, strides=strides, padding=padding, dtype=F64)
    x = distinct(rng, shape)
    y = layer(x)
    ref = naive_maxpool(x, layer.pool_size, layer.strides, padding)
    np.testing.assert_array_equal(y, ref)
    assert y.shape[1:] == layer.compute_output_shape(shape[1:])
    check_layer_gradients(layer, x)


def test_maxpooling_routes_gradient_to_the_max_once_on_ties():
    layer = layers.MaxPooling2D(2)
    x = np.zeros((1, 2, 2, 1), dtype=np.float32)
    layer.forward(x)
    dx = layer.backward(np.ones((1, 1, 1, 1), dtype=np.float32))
    assert dx.sum() == 1.0 and dx[0, 0, 0, 0] == 1.0


def test_flatten_activation_relu_softmax_gradients():
    rng = np.random.default_rng(6)
    check_layer_gradients(layers.Flatten(dtype=F64), rng.standard_normal((2, 3, 2, 2)))
    for name in ["relu", "sigmoid", "tanh", "softmax", "linear"]:
        check_layer_gradients(layers.Activation(name), away_from_zero(rng, (3, 4)))
    check_layer_gradients(layers.ReLU(), away_from_zero(rng, (3, 4)))
    check_layer_gradients(layers.Softmax(), rng.standard_normal((3, 4)))
    check_layer_gradients(layers.Softmax(axis=1), rng.standard_normal((2, 3, 4)))


def test_dropout():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((200, 50)).astype(np.float32)
    layer = layers.Dropout(0.3, seed=1)
    assert layer.forward(x, training=False) is x
    np.testing.assert_array_equal(layer.backward(x), x)
    y = layer.forward(x, training=True)
    assert y.dtype == np.float32
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-6)
    g = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_allclose(layer.backward(g), np.where(kept, g / 0.7, 0), rtol=1e-6)
    again = layers.Dropout(0.3, seed=1).forward(x, training=True)
    np.testing.assert_array_equal(again, y)  # seeded


@pytest.mark.parametrize("synchronized", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,axis", [((6, 3), -1), ((2, 3, 3, 2), -1), ((2, 3, 2, 2), 1)])
def test_batchnorm_gradients(synchronized, training, shape, axis):
    rng = np.random.default_rng(8)
    layer = layers.BatchNormalization(axis=axis, synchronized=synchronized, dtype=F64)
    layer.build(shape[1:], rng=rng)
    channels = shape[axis]
    layer.params["gamma"][:] = rng.uniform(0.5, 1.5, channels)
    layer.params["beta"][:] = rng.standard_normal(channels)
    layer.state["moving_mean"][:] = rng.standard_normal(channels)
    layer.state["moving_variance"][:] = rng.uniform(0.5, 2, channels)
    x = rng.standard_normal(shape) * 2 + 1
    check_layer_gradients(layer, x, training=training)


def test_batchnorm_forward_and_moving_statistics():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((64, 3)) * [1, 2, 3] + [0, 5, -5]).astype(np.float32)
    layer = layers.BatchNormalization(momentum=0.9)
    y = layer(x, training=True)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(y.var(0), x.var(0) / (x.var(0) + 1e-3), rtol=1e-4)
    np.testing.assert_allclose(layer.state["moving_mean"], 0.1 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(layer.state["moving_variance"], 0.9 + 0.1 * x.var(0), rtol=1e-5)
    y_inf = layer(x, training=False)
    expected = (x - layer.state["moving_mean"]) / np.sqrt(layer.state["moving_variance"] + 1e-3)
    np.testing.assert_allclose(y_inf, expected, rtol=1e-5, atol=1e-5)
    assert [k for k, _ in layer.weights_list()] == ["gamma", "beta", "moving_mean", "moving_variance"]


def test_frozen_batchnorm_runs_in_inference_mode():
    x = np.random.default_rng(25).standard_normal((8, 2)).astype(np.float32) + 3
    layer = layers.BatchNormalization(trainable=False)
    y = layer(x, training=True)
    np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-3), rtol=1e-6)
    np.testing.assert_array_equal(layer.state["moving_mean"], 0)


# ---------------------------------------------------------------------------------------------------------
# synchronised BatchNormalization across replicas


class BarrierAllReduce:
    """An in-memory SUM all-reduce for ``n`` threads: each deposits its value, all read the total."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=10)
        self.values: list = [None] * n
        self.calls = 0

    def for_rank(self, rank: int):
        def all_reduce(op: str, value):
            assert op == "SUM"
            self.values[rank] = value.copy()
            self.barrier.wait()
            total = sum(self.values[1:], self.values[0].copy())
            if rank == 0:
                self.calls += 1
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        return all_reduce


def _run_replicas(n: int, fn):
    results: list = [None] * n
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def _full_batch_reference(x, g, gamma, beta):
    ref = layers.BatchNormalization(momentum=0.9, dtype=F64)
    ref.build(x.shape[1:])
    ref.params["gamma"][:] = gamma
    ref.params["beta"][:] = beta
    y = ref.forward(x, training=True)
    dx = ref.backward(g)
    return ref, y, dx


def _sync_replica(rank, n, x, g, gamma, beta, all_reduce):
    xs, gs = np.array_split(x, n), np.array_split(g, n)
    bn = layers.BatchNormalization(momentum=0.9, synchronized=True, all_reduce=all_reduce, dtype=F64)
    bn.build(x.shape[1:])
    bn.params["gamma"][:] = gamma
    bn.params["beta"][:] = beta
    y = bn.forward(xs[rank], training=True)
    dx = bn.backward(gs[rank])
    return y, dx, dict(bn.grads), dict(bn.state)


@pytest.mark.parametrize("shape", [(8, 3), (6, 4, 4, 2)])
def test_synchronized_batchnorm_matches_full_batch(shape):
    rng = np.random.default_rng(10)
    x = rng.standard_normal(shape) * 3 + 2
    g = rng.standard_normal(shape)
    c = shape[-1]
    gamma, beta = rng.uniform(0.5, 1.5, c), rng.standard_normal(c)
    ref, y_ref, dx_ref = _full_batch_reference(x, g, gamma, beta)

    fake = BarrierAllReduce(2)
    out = _run_replicas(2, lambda r: _sync_replica(r, 2, x, g, gamma, beta, fake.for_rank(r)))
    assert fake.calls == 2  # one in forward, one in backward
    np.testing.assert_allclose(np.concatenate([o[0] for o in out]), y_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([o[1] for o in out]), dx_ref, rtol=1e-9, atol=1e-10)
    for key in ("gamma", "beta"):  # param grads are per-replica contributions: they sum to the full-batch ones
        np.testing.assert_allclose(out[0][2][key] + out[1][2][key], ref.grads[key], rtol=1e-10, atol=1e-10)
    for rank in range(2):
        for key in ("moving_mean", "moving_variance"):
            np.testing.assert_allclose(out[rank][3][key], ref.state[key], rtol=1e-10)

    # Without synchronisation each replica uses only its half: different outputs.
    half = layers.BatchNormalization(dtype=F64)
    assert not np.allclose(half(np.array_split(x, 2)[0], training=True), y_ref[: shape[0] // 2])


def test_synchronized_batchnorm_over_in_memory_communicators():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 4)) * 2 - 1
    g = rng.standard_normal((9, 4))
    gamma, beta = rng.uniform(0.5, 1.5, 4), rng.standard_normal(4)
    _, y_ref, dx_ref = _full_batch_reference(x, g, gamma, beta)
    group = InMemoryGroup(3)
    out = group.run_ranks(lambda comm: _sync_replica(comm.rank, 3, x, g, gamma, beta, comm.all_reduce))
    for o in out:
        assert not isinstance(o, Exception), o
    np.testing.assert_allclose(np.concatenate([o[0] for o in out]), y_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([o[1] for o in out]), dx_ref, rtol=1e-9, atol=1e-10)


def test_synchronized_batchnorm_under_a_strategy_on_a_cluster_matches_full_batch(threaded_client):
    """Three replicas of a real cluster, each with its third of the batch, synchronised by the replica context."""
    import daskdist as dd

    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 4)) * 2 - 1
    g = rng.standard_normal((9, 4))
    gamma, beta = rng.uniform(0.5, 1.5, 4), rng.standard_normal(4)
    ref, y_ref, dx_ref = _full_batch_reference(x, g, gamma, beta)

    def replica():
        ctx = dd.get_replica_context()
        y, dx, grads, state = _sync_replica(ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, x, g, gamma,
                                            beta, None)  # no all_reduce given: the replica context's
        return {"y": y, "dx": dx, "gamma": grads["gamma"], "mean": state["moving_mean"]}

    with dd.MirroredStrategy(client=threaded_client) as strategy:
        assert strategy.num_replicas_in_sync == 3
        out = strategy.run(replica)
        local = {key: strategy.experimental_local_results(value) for key, value in out.items()}
    np.testing.assert_allclose(np.concatenate(local["y"]), y_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.concatenate(local["dx"]), dx_ref, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(sum(local["gamma"]), ref.grads["gamma"], rtol=1e-10, atol=1e-10)
    for mean in local["mean"]:  # every replica's moving statistics are the full batch's
        np.testing.assert_allclose(mean, ref.state["moving_mean"], rtol=1e-10)


def test_synchronized_batchnorm_single_replica_defaults_to_local():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    sync = layers.BatchNormalization(synchronized=True)  # default context: one replica
    local = layers.BatchNormalization()
    np.testing.assert_allclose(sync(x, training=True), local(x, training=True), rtol=1e-4, atol=1e-5)
    g = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_allclose(sync.backward(g), local.backward(g), rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# convolution and pooling against references


@pytest.mark.parametrize(
    "h,w,kernel_size,strides,padding",
    [(7, 7, 3, 1, "valid"), (7, 7, 3, 1, "same"), (7, 6, 3, 2, "same"), (8, 8, 3, 2, "valid"),
     (5, 5, 2, 1, "same"), (6, 5, (3, 2), (2, 1), "same"), (5, 5, 4, 3, "same"), (6, 6, 1, 2, "valid")],
)
def test_conv2d_matches_naive_reference(h, w, kernel_size, strides, padding):
    rng = np.random.default_rng(13)
    layer = layers.Conv2D(4, kernel_size, strides=strides, padding=padding, dtype=F64)
    x = rng.standard_normal((2, h, w, 3))
    layer.build(x.shape[1:], rng=rng)
    layer.params["bias"][:] = rng.standard_normal(4)
    y = layer(x)
    ref = naive_conv2d(x, layer.params["kernel"], layer.params["bias"], layer.strides, padding)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    assert y.shape[1:] == layer.compute_output_shape(x.shape[1:])


@pytest.mark.parametrize("kernel,strides,padding", [((3, 3), (1, 1), "same"), ((2, 3), (2, 1), "valid"),
                                                    ((3, 2), (3, 2), "same"), ((1, 1), (1, 1), "valid")])
def test_im2col_col2im_are_adjoint(kernel, strides, padding):
    rng = np.random.default_rng(26)
    x = rng.standard_normal((2, 5, 6, 3))
    cols, out_hw, pads = backend.im2col(x, kernel, strides, padding)
    assert cols.shape == (2 * out_hw[0] * out_hw[1], kernel[0] * kernel[1] * 3) and cols.flags.c_contiguous
    d = rng.standard_normal(cols.shape)
    back = backend.col2im(d, x.shape, kernel, strides, out_hw, pads)
    assert np.vdot(cols, d) == pytest.approx(np.vdot(x, back), rel=1e-12)
    w = rng.standard_normal(kernel + (3, 4))
    g = rng.standard_normal((cols.shape[0], 4))
    np.testing.assert_allclose(backend.conv2d_input_gradient(g, w, x.shape, strides, out_hw, pads),
                               backend.col2im(g @ w.reshape(-1, 4).T, x.shape, kernel, strides, out_hw, pads),
                               rtol=1e-12, atol=1e-12)


def test_same_padding_puts_the_odd_pixel_at_the_end():
    # TensorFlow: a 2-wide kernel with 'same' pads one column on the right, none on the left.
    layer = layers.Conv2D(1, (1, 2), padding="same", use_bias=False, dtype=F64)
    layer.build((1, 3, 1))
    layer.params["kernel"][:] = np.array([1.0, 10.0]).reshape(1, 2, 1, 1)
    y = layer(np.array([1.0, 2.0, 3.0]).reshape(1, 1, 3, 1))
    np.testing.assert_array_equal(y.ravel(), [21.0, 32.0, 3.0])


def test_conv2d_float32_on_uint8_images():
    rng = np.random.default_rng(14)
    layer = layers.Conv2D(2, 3, activation="relu")
    y = layer(rng.integers(0, 255, (2, 6, 6, 1), dtype=np.uint8), training=True)
    assert y.dtype == np.float32 and layer.params["kernel"].dtype == np.float32
    assert layer.backward(np.ones_like(y)).dtype == np.float32


# ---------------------------------------------------------------------------------------------------------
# dtypes, weights, configs


def _small_cnn():
    return [
        layers.Conv2D(4, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
        layers.BatchNormalization(),
        layers.MaxPooling2D(),
        layers.Conv2D(4, 3, strides=2, activation="relu"),
        layers.Flatten(),
        layers.Dropout(0.2, seed=0),
        layers.Dense(8, activation="tanh"),
        layers.Dense(3, activation="softmax"),
    ]


def _build_stack(stack, input_shape, rng=None):
    shape = input_shape
    for layer in stack:
        layer.build(shape, rng=rng)
        shape = layer.compute_output_shape(shape)
    return shape


def test_float32_throughout_forward_and_backward():
    rng = np.random.default_rng(15)
    stack = _small_cnn()
    assert _build_stack(stack, (8, 8, 1), rng) == (3,)
    x = rng.standard_normal((4, 8, 8, 1)).astype(np.float32)
    for layer in stack:
        x = layer.forward(x, training=True)
        assert x.dtype == np.float32, layer.name
    g = losses.CategoricalCrossentropy().gradient(np.eye(3)[[0, 1, 2, 0]], x)
    assert g.dtype == np.float32
    for layer in reversed(stack):
        g = layer.backward(g)
        assert g.dtype == np.float32, layer.name
        assert all(v.dtype == np.float32 for v in layer.grads.values()), layer.name
    assert g.shape == (4, 8, 8, 1)


def test_weights_list_and_set_weights_from():
    rng = np.random.default_rng(16)
    a, b = layers.Dense(3, name="a"), layers.Dense(3, name="b")
    a.build((2,), rng=rng)
    b.build((2,), rng=rng)
    assert [k for k, _ in a.weights_list()] == ["kernel", "bias"]
    b.set_weights_from(dict(a.weights_list()))
    for (ka, va), (kb, vb) in zip(a.weights_list(), b.weights_list()):
        assert ka == kb and va is not vb
        np.testing.assert_array_equal(va, vb)
    b.set_weights_from({"bias": np.ones(3)})  # partial, cast to the layer dtype
    assert b.params["bias"].dtype == np.float32 and b.params["bias"].sum() == 3
    with pytest.raises(KeyError):
        b.set_weights_from({"gamma": np.ones(3)})
    with pytest.raises(ValueError):
        b.set_weights_from({"bias": np.ones(4)})
    assert a.count_params() == 9


def test_automatic_names_are_unique():
    backend.clear_session()
    names = [layers.Dense(1).name, layers.Dense(1).name, layers.MaxPooling2D().name, layers.BatchNormalization().name]
    assert names == ["dense", "dense_1", "max_pooling2d", "batch_normalization"]


def test_layer_config_round_trips():
    configs = [
        layers.Dense(5, activation="relu", use_bias=False, kernel_initializer="he_normal", input_shape=(3,)),
        layers.Conv2D(8, (3, 2), strides=2, padding="same", activation="sigmoid", name="c"),
        layers.MaxPooling2D((2, 3), strides=1, padding="same"),
        layers.Flatten(),
        layers.Dropout(0.25, seed=3),
        layers.Activation("tanh"),
        layers.ReLU(),
        layers.Softmax(axis=1),
        layers.BatchNormalization(axis=1, momentum=0.9, epsilon=1e-5, synchronized=True, trainable=False),
    ]
    for layer in configs:
        spec = json.loads(json.dumps(layers.serialize(layer)))
        clone = layers.deserialize(spec)
        assert type(clone) is type(layer)
        assert clone.get_config() == layer.get_config()
        assert layers.get_layer_class(type(layer).__name__) is type(layer)
    assert configs[0].input_shape == (3,) and layers.deserialize(layers.serialize(configs[0])).input_shape == (3,)
    with pytest.raises(ValueError):
        layers.get_layer_class("NoSuchLayer")


def test_layers_pickle_without_their_caches():
    layer = layers.Dense(3)
    layer(np.ones((4, 2), dtype=np.float32), training=True)
    clone = pickle.loads(pickle.dumps(layer))
    assert clone._cache == {} and clone.built
    np.testing.assert_array_equal(clone.params["kernel"], layer.params["kernel"])


def test_output_shapes():
    assert layers.Conv2D(6, 5).compute_output_shape((28, 28, 1)) == (24, 24, 6)
    assert layers.Conv2D(6, 3, strides=2, padding="same").compute_output_shape((28, 28, 1)) == (14, 14, 6)
    assert layers.MaxPooling2D().compute_output_shape((7, 7, 4)) == (3, 3, 4)
    assert layers.MaxPooling2D(padding="same").compute_output_shape((7, 7, 4)) == (4, 4, 4)
    assert layers.Flatten().compute_output_shape((3, 3, 4)) == (36,)
    assert layers.Dense(10).compute_output_shape((36,)) == (10,)


# ---------------------------------------------------------------------------------------------------------
# activations and initializers


@pytest.mark.parametrize("name", ["relu", "sigmoid", "tanh", "linear"])
def test_activation_derivatives(name):
    act = activations.get(name)
    x = away_from_zero(np.random.default_rng(17), (20,))
    y = act(x)
    eps = 1e-6
    numeric = (act(x + eps) - act(x - eps)) / (2 * eps)
    np.testing.assert_allclose(act.derivative(x, y), numeric, rtol=1e-6, atol=1e-8)


def test_softmax_jacobian_and_stability():
    x = np.random.default_rng(18).standard_normal((2, 4))
    y = activations.softmax(x)
    jac = activations.softmax.derivative(x, y)
    eps = 1e-6
    for k in range(4):
        d = np.zeros(4)
        d[k] = eps
        np.testing.assert_allclose(jac[:, :, k], (activations.softmax(x + d) - activations.softmax(x - d)) / (2 * eps),
                                   atol=1e-8)
    big = np.array([[1e4, 0.0, -1e4]], dtype=np.float32)
    assert np.isfinite(activations.softmax(big)).all() and np.isfinite(activations.sigmoid(big)).all()
    assert activations.get(None) is activations.linear and activations.get(activations.relu) is activations.relu
    with pytest.raises(TypeError):
        activations.get(lambda v: v)
    with pytest.raises(ValueError):
        activations.get("nope")


def test_initializers():
    rng = lambda: np.random.default_rng(19)  # noqa: E731
    a = initializers.get("glorot_uniform")((50, 30), rng=rng())
    np.testing.assert_array_equal(a, initializers.get("glorot_uniform")((50, 30), rng=rng()))
    assert a.dtype == np.float32 and np.abs(a).max() <= math.sqrt(6 / 80)
    h = initializers.get("he_normal")((3, 3, 16, 400), rng=rng())
    assert abs(h.std() - math.sqrt(2 / 144)) / math.sqrt(2 / 144) < 0.05
    assert np.abs(h).max() <= 2 * math.sqrt(2 / 144) / 0.87962566103423978 + 1e-6
    assert initializers.get("zeros")((2,)).sum() == 0 and initializers.get("ones")((2,)).sum() == 2
    assert initializers.compute_fans((3, 3, 4, 8)) == (36, 72)
    for init in [initializers.HeNormal(), initializers.Constant(0.5)]:
        assert type(initializers.get(json.loads(json.dumps(initializers.serialize(init))))) is type(init)


# ---------------------------------------------------------------------------------------------------------
# losses


def _loss_cases():
    rng = np.random.default_rng(20)
    logits = rng.standard_normal((5, 4)) * 2
    probs = activations.softmax(logits)
    labels = rng.integers(0, 4, 5)
    onehot = np.eye(4)[labels]
    soft = rng.dirichlet(np.ones(4), 5)
    return [
        (losses.SparseCategoricalCrossentropy(from_logits=True), labels, logits),
        (losses.SparseCategoricalCrossentropy(), labels.reshape(-1, 1), probs * 1.3),  # unnormalised probs
        (losses.CategoricalCrossentropy(from_logits=True), soft, logits),
        (losses.CategoricalCrossentropy(), onehot, probs),
        (losses.MeanSquaredError(), rng.standard_normal((5, 3)), rng.standard_normal((5, 3))),
        (losses.MeanSquaredError(), rng.standard_normal(5), rng.standard_normal((5, 1))),
        (losses.SparseCategoricalCrossentropy(from_logits=True), rng.integers(0, 3, (2, 4)),
         rng.standard_normal((2, 4, 3))),  # per-position labels
    ]


@pytest.mark.parametrize("case", range(7))
def test_loss_gradients(case):
    loss, y_true, y_pred = _loss_cases()[case]
    y_pred = y_pred.copy()
    per = loss.per_example(y_true, y_pred)
    assert per.shape == (y_pred.shape[0],)
    grad = loss.gradient(y_true, y_pred)
    assert grad.shape == y_pred.shape
    r = np.random.default_rng(case).standard_normal(per.shape)
    numeric = numeric_grad(lambda: float((loss.per_example(y_true, y_pred) * r).sum()), y_pred)
    # per-example gradients: weighting example i by r[i] scales its gradient row by r[i]
    np.testing.assert_allclose(grad * r.reshape((-1,) + (1,) * (y_pred.ndim - 1)), numeric, rtol=1e-5, atol=1e-7)
    assert loss(y_true, y_pred) == pytest.approx(per.mean())


def test_loss_values_and_stability():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    labels = np.array([1, 2])
    scce = losses.get("sparse_categorical_crossentropy")
    per = losses.SparseCategoricalCrossentropy(from_logits=True).per_example(labels, logits)
    assert per.dtype == np.float32
    np.testing.assert_allclose(per, [1000.0, math.log(3)], rtol=1e-6)
    g = losses.SparseCategoricalCrossentropy(from_logits=True).gradient(labels, logits)
    np.testing.assert_allclose(g, [[1, -1, 0], [1 / 3, 1 / 3, -2 / 3]], atol=1e-6)
    probs = np.array([[0.0, 1.0, 0.0]], dtype=np.float32)
    assert np.isfinite(scce.per_example(np.array([0]), probs)).all()
    np.testing.assert_allclose(scce.per_example(np.array([0]), probs), -math.log(1e-7), rtol=1e-4)
    # from probabilities == from logits when the probabilities are a softmax
    z = np.random.default_rng(21).standard_normal((4, 5))
    y = np.array([0, 1, 4, 2])
    np.testing.assert_allclose(scce.per_example(y, activations.softmax(z)),
                               losses.SparseCategoricalCrossentropy(from_logits=True).per_example(y, z), rtol=1e-10)
    np.testing.assert_allclose(losses.get("mse").per_example(np.zeros((2, 2)), np.array([[1.0, 3.0], [2, 2]])),
                               [5.0, 4.0])


def test_compute_average_loss():
    per = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    assert float(losses.compute_average_loss(per)) == pytest.approx(2.5)  # one replica by default
    assert float(losses.compute_average_loss(per, global_batch_size=8)) == pytest.approx(1.25)
    assert float(losses.compute_average_loss(per, 8, sample_weight=np.array([1, 0, 0, 1]))) == pytest.approx(0.625)


def test_loss_lookup_and_configs():
    assert isinstance(losses.get("mse"), losses.MeanSquaredError)
    assert isinstance(losses.get("mean_squared_error"), losses.MeanSquaredError)
    assert isinstance(losses.get("categorical_crossentropy"), losses.CategoricalCrossentropy)
    obj = losses.SparseCategoricalCrossentropy(from_logits=True)
    assert losses.get(obj) is obj
    clone = losses.get(json.loads(json.dumps(losses.serialize(obj))))
    assert isinstance(clone, losses.SparseCategoricalCrossentropy) and clone.from_logits
    assert losses.SparseCategoricalCrossentropy.from_config(obj.get_config()).get_config() == obj.get_config()
    with pytest.raises(ValueError):
        losses.get("hinge-ish")


# ---------------------------------------------------------------------------------------------------------
# optimizers


def test_sgd_updates():
    p = np.array([1.0, -2.0], dtype=np.float32)
    g = np.array([0.5, 1.0], dtype=np.float32)
    ref = p
    opt = optimizers.SGD(learning_rate=0.1)
    opt.apply([p], [g])
    assert p is ref  # in place
    np.testing.assert_allclose(p, [0.95, -2.1], rtol=1e-6)
    assert opt.iterations == 1 and p.dtype == np.float32


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_updates(nesterov):
    lr, mu = 0.1, 0.9
    p = np.array([1.0, -2.0])
    grads = [np.array([0.5, 1.0]), np.array([-1.0, 2.0])]
    opt = optimizers.SGD(learning_rate=lr, momentum=mu, nesterov=nesterov)
    expected, v = p.copy(), np.zeros(2)
    for g in grads:
        opt.apply([p], [g])
        v = mu * v - lr * g
        expected = expected + (mu * v - lr * g if nesterov else v)
        np.testing.assert_allclose(p, expected, rtol=1e-12)


def test_adam_updates():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-7
    p = np.array([1.0, -2.0, 0.5])
    ref = p
    grads = [np.array([0.5, -1.0, 0.0]), np.array([0.1, 2.0, -3.0])]
    opt = optimizers.Adam(learning_rate=lr)
    expected, m, v = p.copy(), np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads, start=1):
        opt.apply([p], [g])
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        expected = expected - lr * m_hat / (np.sqrt(v_hat) + eps / math.sqrt(1 - b2 ** t))  # Keras' eps placement
        np.testing.assert_allclose(p, expected, rtol=1e-10)
    assert p is ref and opt.iterations == 2
    # first step of Adam moves each coordinate by ~lr in the direction of -sign(g)
    q = np.array([0.0, 0.0])
    optimizers.Adam(learning_rate=0.1).apply([q], [np.array([3.0, -0.2])])
    np.testing.assert_allclose(q, [-0.1, 0.1], rtol=1e-4)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_rmsprop_updates(momentum):
    lr, rho, eps = 0.01, 0.9, 1e-7
    p = np.array([1.0, -2.0])
    grads = [np.array([0.5, -1.0]), np.array([0.1, 2.0])]
    opt = optimizers.get("rmsprop")
    assert isinstance(opt, optimizers.RMSprop)
    opt = optimizers.RMSprop(learning_rate=lr, momentum=momentum)
    expected, v, mom = p.copy(), np.zeros(2), np.zeros(2)
    for g in grads:
        opt.apply([p], [g])
        v = rho * v + (1 - rho) * g * g
        mom = momentum * mom + lr * g / np.sqrt(v + eps)
        expected = expected - mom
        np.testing.assert_allclose(p, expected, rtol=1e-12)
    assert set(opt.get_state()) == ({"iterations", "velocity/0", "momentum/0"} if momentum else
                                    {"iterations", "velocity/0"})


def test_optimizer_learning_rate_alias_state_and_config():
    opt = optimizers.get("adam")
    assert isinstance(opt, optimizers.Adam) and opt.learning_rate == 0.001
    opt.lr = 0.5
    assert opt.learning_rate == 0.5
    opt.learning_rate = 0.25
    assert opt.lr == 0.25 and opt.lr.numpy() == 0.25 and type(opt.get_config()["learning_rate"]) is float

    rng = np.random.default_rng(22)
    params = [rng.standard_normal((3, 2)), rng.standard_normal(2)]
    grads = [[rng.standard_normal(p.shape) for p in params] for _ in range(3)]
    a = optimizers.Adam(learning_rate=0.05)
    pa = [p.copy() for p in params]
    a.apply(pa, grads[0])
    state = {k: np.array(v) for k, v in a.get_state().items()}
    assert set(state) == {"iterations", "m/0", "m/1", "v/0", "v/1"}
    b = optimizers.get(json.loads(json.dumps(optimizers.serialize(a))))
    assert b.get_config() == a.get_config()
    b.set_state({**state, "iterations": np.array([1])})  # a checkpoint may store it as a 1-element array
    pb = [p.copy() for p in pa]
    for g in grads[1:]:
        a.apply(pa, g)
        b.apply(pb, g)
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)
    assert b.iterations == 3

    sgd = optimizers.get("sgd")
    assert isinstance(sgd, optimizers.SGD) and sgd.learning_rate == 0.01
    clone = optimizers.SGD.from_config(optimizers.SGD(0.2, momentum=0.5, nesterov=True).get_config())
    assert (clone.learning_rate, clone.momentum, clone.nesterov) == (0.2, 0.5, True)
    with pytest.raises(ValueError):
        optimizers.SGD().apply([np.zeros(2)], [np.zeros(3)])
    with pytest.raises(ValueError):
        optimizers.get("lbfgs")


# ---------------------------------------------------------------------------------------------------------
# metrics


def test_accuracy_metrics():
    y_pred = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], dtype=np.float32)
    m = metrics.SparseCategoricalAccuracy()
    m.update_state(np.array([1, 0, 0, 0]), y_pred)
    assert m.result() == pytest.approx(0.75)
    m.update_state(np.array([[0], [0]]), y_pred[:2])
    assert m.result() == pytest.approx(4 / 6)
    np.testing.assert_array_equal(m.totals(), [4.0, 6.0])
    m.set_totals(m.totals() * 2)  # as after a SUM all-reduce over two identical replicas
    assert m.result() == pytest.approx(4 / 6) and m.count == 12
    m.reset_state()
    assert m.result() == 0.0 and list(m.totals()) == [0.0, 0.0]

    c = metrics.CategoricalAccuracy()
    c.update_state(np.eye(2)[[1, 1, 1, 0]], y_pred, sample_weight=np.array([1.0, 1.0, 0.0, 2.0]))
    assert c.result() == pytest.approx(3 / 4)
    a = metrics.Accuracy()
    a.update_state(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4]))
    assert a.result() == pytest.approx(0.75)


def test_mean_metric():
    m = metrics.Mean(name="loss")
    m.update_state(2.0)
    m.update_state(np.array([4.0, 6.0]))
    assert m.result() == pytest.approx(4.0)
    m.reset_state()
    m.update_state(1.0, sample_weight=3)
    m.update_state(5.0, sample_weight=1)
    assert m.result() == pytest.approx(2.0) and m.name == "loss"


def test_metric_lookup():
    acc = metrics.get("accuracy", loss="sparse_categorical_crossentropy")
    assert type(acc) is metrics.SparseCategoricalAccuracy and acc.name == "accuracy"
    assert type(metrics.get("accuracy", loss=losses.CategoricalCrossentropy())) is metrics.CategoricalAccuracy
    assert type(metrics.get("acc", loss=losses.SparseCategoricalCrossentropy(True))) is metrics.SparseCategoricalAccuracy
    assert metrics.get("acc", loss="sparse_categorical_crossentropy").name == "acc"
    assert type(metrics.get("sparse_categorical_accuracy")) is metrics.SparseCategoricalAccuracy
    auto = metrics.get("accuracy")
    auto.update_state(np.array([1, 0]), np.array([[0.2, 0.8], [0.4, 0.6]]))
    assert auto.result() == 0.5
    for metric in [acc, metrics.Mean("loss"), metrics.BinaryAccuracy(threshold=0.3)]:
        clone = metrics.get(json.loads(json.dumps(metrics.serialize(metric))))
        assert type(clone) is type(metric) and clone.get_config() == metric.get_config()
    with pytest.raises(ValueError):
        metrics.get("f1ish")


# ---------------------------------------------------------------------------------------------------------
# end to end


def _train(stack, loss, opt, x, y, steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        out = x[idx]
        for layer in stack:
            out = layer.forward(out, training=True)
        grad = loss.gradient(y[idx], out) / batch
        for layer in reversed(stack):
            grad = layer.backward(grad)
        params = [p for layer in stack for p in layer.params.values()]
        grads = [layer.grads[k] for layer in stack for k in layer.params]
        opt.apply(params, grads)


def _predict(stack, x):
    for layer in stack:
        x = layer.forward(x, training=False)
    return x


def test_mlp_learns_concentric_circles():
    rng = np.random.default_rng(23)
    n = 600
    radius = np.where(np.arange(n) % 2 == 0, rng.uniform(0, 1, n), rng.uniform(1.6, 2.5, n))
    angle = rng.uniform(0, 2 * np.pi, n)
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1).astype(np.float32)
    y = (np.arange(n) % 2).astype(np.int64)
    stack = [layers.Dense(16, activation="relu"), layers.Dense(2)]
    _build_stack(stack, (2,), rng)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    before = loss(y, _predict(stack, x))
    _train(stack, loss, optimizers.SGD(0.1, momentum=0.9), x, y, steps=300, batch=32)
    acc = metrics.SparseCategoricalAccuracy()
    logits = _predict(stack, x)
    acc.update_state(y, logits)
    assert acc.result() > 0.95
    assert loss(y, logits) < before / 3
    assert logits.dtype == np.float32


def test_small_cnn_learns_bar_orientation():
    rng = np.random.default_rng(24)
    n = 256
    x = rng.normal(0, 0.3, (n, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 2, n)
    pos = rng.integers(1, 7, n)
    for i in range(n):
        if y[i]:
            x[i, :, pos[i], 0] += 1.0
        else:
            x[i, pos[i], :, 0] += 1.0
    stack = [
        layers.Conv2D(4, 3, padding="same", activation="relu"),
        layers.BatchNormalization(),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(2, activation="softmax"),
    ]
    _build_stack(stack, (8, 8, 1), rng)
    loss = losses.get("sparse_categorical_crossentropy")
    _train(stack, loss, optimizers.Adam(0.01), x, y, steps=150, batch=32)
    acc = metrics.get("accuracy", loss=loss)
    acc.update_state(y, _predict(stack, x))
    assert acc.result() > 0.95
