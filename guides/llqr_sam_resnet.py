"""
Title: LLQR+SAM on a ResNet image classifier
Author: keras_geosam authors
Date created: 2026/12/01
Last modified: 2026/12/01
Description: kg.attach on a ResNet, a K-FAC preconditioner, sharpness in
    TensorBoard, checkpoints, and resuming with the optimizer state intact.
Accelerator: GPU (for --full; the small default mode runs on a CPU)

Run it with any Keras backend (about a minute on 2 CPU cores, most of it
compiling the train step, the refresh and the sharpness measures):

    KERAS_BACKEND=jax python guides/llqr_sam_resnet.py

The default mode trains a small pre-activation ResNet, written below in
plain `keras.layers`, on random 32x32 images for two epochs, then reloads
the checkpoint and trains one more. It writes TensorBoard logs (`logs/`),
a `.keras` checkpoint per epoch (`checkpoints/`), and the numbers it shows
(`facts.json`, `state.npz`) under `--output` (default
`geosam_output/llqr_sam_resnet/`). Options:

- `--full`: CIFAR-10 through `keras.datasets` (the file must already be in
  Keras' cache, or the machine online), a ResNet-20-sized network, 30 epochs.
- `--data file.npz`: your own images (keys `x_train, y_train, x_test, y_test`).
- `--model keras-cv`: keras-cv's `ImageClassifier` around a
  `ResNetV2Backbone` built from explicit arguments
  (`pip install keras-cv tensorflow-datasets`).
- `--smoke`: the smallest run, for tests.

Look at the curves with `tensorboard --logdir geosam_output/llqr_sam_resnet/logs`.
"""

"""
## Setup

Any Keras 3 backend works; pick it with `KERAS_BACKEND` before Keras is
imported.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras
import numpy as np

import keras_geosam as kg

# Per mode: examples, epochs before the resume, batch size, ResNet width and
# blocks per stage, U's refresh period and inner steps, and the sharpness
# logging (metrics, probe examples, Hutchinson probes, every how many
# epochs). Each metric's first evaluation compiles it (10-20 s on a CPU for
# the K-FAC metric), so the short modes log two metrics, once, at the end of
# epoch 2. Width 8 at least: PyTorch 2.13's oneDNN kernel for the gradient
# of a strided 1x1 convolution with fewer than 8 input channels never
# returns on CPUs with AVX2 and no AVX-512 (the shortcut projections here).
SHORT_METRICS = ("riemannian_sharpness", "hessian_trace")
SIZES = {
    "smoke": dict(n_train=64, n_test=32, epochs=2, batch=16, width=8, blocks=1,
                  refresh_every=4, refresh_steps=2, metrics=SHORT_METRICS, n_probe=32, probes=4,
                  log_every=2),
    "small": dict(n_train=256, n_test=64, epochs=2, batch=32, width=8, blocks=1,
                  refresh_every=8, refresh_steps=20, metrics=SHORT_METRICS, n_probe=64, probes=10,
                  log_every=2),
    "full": dict(n_train=None, n_test=None, epochs=30, batch=128, width=16, blocks=3,
                 refresh_every=200, refresh_steps=50, n_probe=512, probes=20, log_every=5,
                 metrics=SHORT_METRICS + ("riemannian_sharpness_kfac", "lambda_max")),
}


"""
## Data

Three sources, all returning float32 images in [0, 1] and integer labels:

- the default: random images tinted by a class-dependent colour, so the
  network has something to learn and nothing is downloaded;
- CIFAR-10 via `keras_geosam.datasets.load("cifar10")`, which wraps
  `keras.datasets.cifar10.load_data()` and says clearly when the file is
  neither cached nor downloadable;
- an `.npz` file of your own, checked by `keras_geosam.datasets.load_npz`
  (it names the offending key when something is missing or inconsistent).
"""


def random_images(n_train, n_test, num_classes=10, shape=(32, 32, 3), seed=0):
    rng = np.random.default_rng(seed)
    colours = rng.uniform(size=(num_classes, shape[-1]))

    def draw(n):
        y = rng.integers(0, num_classes, size=n).astype("int32")
        x = 0.6 * rng.uniform(size=(n,) + shape) + 0.4 * colours[y][:, None, None, :]
        return x.astype("float32"), y

    return draw(n_train), draw(n_test), num_classes


def load_data(args, size):
    from keras_geosam import datasets

    if args.data:
        if hasattr(datasets, "load_npz"):
            return datasets.load_npz(args.data)
        # Older keras_geosam: read the file and check the essentials here.
        with np.load(args.data) as f:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f.files]
            if missing:
                raise ValueError(f"{args.data} lacks key(s) {missing}.")
            xs = [f[k].astype("float32") for k in ("x_train", "x_test")]
            ys = [f[k].reshape(-1).astype("int32") for k in ("y_train", "y_test")]
        for x, y, split in zip(xs, ys, ("train", "test")):
            if len(x) != len(y):
                raise ValueError(f"x_{split} has {len(x)} examples but y_{split} has {len(y)}.")
        return (xs[0], ys[0]), (xs[1], ys[1]), int(max(ys[0].max(), ys[1].max())) + 1
    if args.dataset == "cifar10":
        try:
            (x, y), (xt, yt), k = datasets.load("cifar10")
        except RuntimeError as e:  # not cached and offline
            raise SystemExit(f"{e}\nThis guide also runs on random images (the default) or on --data file.npz.") from e
        if size["n_train"]:  # a subset outside --full keeps the CPU run short
            x, y, xt, yt = x[: size["n_train"]], y[: size["n_train"]], xt[: size["n_test"]], yt[: size["n_test"]]
        return (x, y), (xt, yt), k
    return random_images(size["n_train"], size["n_test"])


"""
## A small pre-activation ResNet in plain Keras layers

He et al.'s CIFAR ResNet with pre-activation blocks (BN -> ReLU -> conv,
twice, plus the shortcut): three stages of width `w`, `2w`, `4w`, the
last two starting with stride 2, then global average pooling and a Dense
layer that outputs logits. `width=16, blocks=3` is ResNet-20. Nothing here
is specific to keras_geosam: it is the kind of model you already have.
"""


# momentum=0.9 (PyTorch's default) rather than Keras' 0.99: the running
# statistics that evaluation uses catch up within a few dozen steps, which
# matters for the short runs here.
def bn(name):
    return keras.layers.BatchNormalization(momentum=0.9, name=name)


def preact_block(x, filters, stride, name):
    h = bn(f"{name}_bn1")(x)
    h = keras.layers.ReLU(name=f"{name}_relu1")(h)
    if stride != 1 or x.shape[-1] != filters:
        # The projection sees the normalised input, as in the pre-activation paper.
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(h)
    else:
        shortcut = x
    h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(h)
    h = bn(f"{name}_bn2")(h)
    h = keras.layers.ReLU(name=f"{name}_relu2")(h)
    h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(h)
    return keras.layers.Add(name=f"{name}_add")([shortcut, h])


def cifar_resnet(input_shape, num_classes, width=16, blocks=3):
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inputs)
    for stage in range(3):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = preact_block(x, width * 2**stage, stride, name=f"s{stage}b{block}")
    x = bn("final_bn")(x)
    x = keras.layers.ReLU(name="final_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cifar_resnet")


"""
## Or keras-cv's ResNetV2

keras-cv 0.9 (its last release) builds a `ResNetV2Backbone` from explicit
arguments on every backend; preset names such as `ResNet18V2Backbone()`
download a configuration first and fail offline. Its stem (a 7x7 stride-2
convolution and a stride-2 max-pool) is made for ImageNet: on 32x32 images
the first stack sees 8x8 maps, and with `block_type="basic_block"` the
first stack must have 64 filters (its shortcut is the identity) and each
stack at least 2 blocks. keras-cv imports TensorFlow whatever the backend.

keras-hub, keras-cv's successor, has no CIFAR-style ResNet either, and its
install pulls `tensorflow-text` and the full `tensorflow` package;
`kg.attach` takes its models like any other `keras.Model`.
"""


def keras_cv_resnet(input_shape, num_classes, full):
    try:
        import keras_cv
    except ImportError as e:
        raise SystemExit(
            f"--model keras-cv needs keras-cv ({e}). Install it with\n"
            "    pip install keras-cv tensorflow-datasets\n"
            "or use the default --model resnet, which needs nothing extra."
        ) from e
    stacks = 4 if full else 2
    backbone = keras_cv.models.ResNetV2Backbone(
        stackwise_filters=[64, 128, 256, 512][:stacks],
        stackwise_blocks=[2] * stacks,
        stackwise_strides=[1, 2, 2, 2][:stacks],
        block_type="basic_block",
        include_rescaling=False,  # our images are already in [0, 1]
        input_shape=input_shape,
    )
    # activation=None: logits, so the loss (and the Fisher) use from_logits.
    return keras_cv.models.ImageClassifier(backbone=backbone, num_classes=num_classes, activation=None)


def u_values(optimizer):
    """LLQR's U parameters (K-FAC factors and diagonal blocks) as arrays."""
    return [keras.ops.convert_to_numpy(v) for v in optimizer.preconditioner.variables]


def main(argv=None):
    p = argparse.ArgumentParser(description="LLQR+SAM on a ResNet, with TensorBoard, checkpoints and resume.")
    p.add_argument("--model", choices=("resnet", "keras-cv"), default="resnet",
                   help="plain-Keras CIFAR ResNet (default) or keras-cv's ResNetV2 (needs keras-cv)")
    p.add_argument("--dataset", choices=("random", "cifar10"), default=None,
                   help="default: cifar10 with --full, else random images")
    p.add_argument("--data", default=None,
                   help="an .npz with x_train, y_train, x_test, y_test (images N x H x W x C)")
    p.add_argument("--full", action="store_true", help="all of CIFAR-10, ResNet-20, 30 epochs (use a GPU)")
    p.add_argument("--smoke", action="store_true", help="the smallest run, for tests")
    p.add_argument("--epochs", type=int, default=None, help="epochs before the resume (default by mode)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--rho", type=float, default=0.1, help="SAM radius (default 0.1)")
    p.add_argument("--output", default=os.path.join("geosam_output", "llqr_sam_resnet"),
                   help="folder for logs/, checkpoints/, facts.json and state.npz")
    args = p.parse_args(argv)
    size = dict(SIZES["full" if args.full else "smoke" if args.smoke else "small"])
    if args.epochs:
        size["epochs"] = args.epochs
    args.dataset = args.dataset or ("cifar10" if args.full else "random")
    os.makedirs(args.output, exist_ok=True)
    log_dir = os.path.join(args.output, "logs")
    # One file per epoch, so the resume below can pick the one it wants.
    ckpt = os.path.join(args.output, "checkpoints", "epoch_{epoch:02d}.keras")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    facts = {"backend": keras.backend.backend(), "model": args.model,
             "data": args.data or args.dataset, "mode": "full" if args.full else "smoke" if args.smoke else "small"}
    start = time.perf_counter()
    keras.utils.set_random_seed(0)

    (x, y), (xt, yt), num_classes = load_data(args, size)
    if x.ndim != 4:
        raise SystemExit(f"This guide trains on images shaped (N, height, width, channels); got x_train {x.shape}.")
    if x.max() > 1.5:  # 0-255 pixels, e.g. straight from an image library
        x, xt = x / 255.0, xt / 255.0
    print(f"data: {facts['data']}, train {x.shape}, test {xt.shape}, {num_classes} classes")

    """
    ## Attach the two-pass step

    SAM needs two gradients per batch (at theta and at theta + eps), and
    Keras optimizers only ever receive one. `kg.attach(model)` gives this
    model instance a train step that takes both, on the same batch; the
    class is untouched, and with an ordinary optimizer the model trains as
    before. It works on any `keras.Model`: a functional one like ours, a
    subclassed one, or keras-cv's `ImageClassifier`.
    """
    if args.model == "keras-cv":
        model = keras_cv_resnet(x.shape[1:], num_classes, args.full)
    else:
        model = cifar_resnet(x.shape[1:], num_classes, width=size["width"], blocks=size["blocks"])
    model = kg.attach(model)
    facts["num_params"] = int(model.count_params())
    print(f"model: {args.model}, {facts['num_params']} parameters")

    """
    ## LLQR+SAM with a K-FAC preconditioner

    LLQR learns a structured preconditioner U on a slow timescale: every
    `refresh_every` steps (step 0 included) a short inner optimisation
    (`refresh_steps` heavy-ball steps) fits U to the local Fisher, on the
    current batch. Between refreshes U shapes both the SAM perturbation and
    the descent step. `structure="kfac"` gives every Dense and Conv kernel a
    Kronecker-factored block (A X B^T) and every other tensor (BatchNorm
    scales, biases) a diagonal one.

    A refresh costs many SGD steps (it differentiates the Fisher product),
    so keep `refresh_every` large on real runs; here it is small so the
    short run sees refreshes, and `refresh_steps` is cut for CPU speed.
    """
    optimizer = kg.optimizers.LLQRSAM(
        keras.optimizers.SGD(args.lr, momentum=0.9),
        rho=args.rho,
        structure="kfac",
        refresh_every=size["refresh_every"],
        refresh_steps=size["refresh_steps"],
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    """
    ## Sharpness in TensorBoard, checkpoints every epoch

    `kg.callbacks.SharpnessLogger` evaluates sharpness measures on a fixed
    probe set at the end of every `every_n_epochs`-th epoch, with fixed
    probe seeds so epochs differ only by the weights. It adds the values to
    the epoch `logs`, each with its standard error (`..._stderr`) and, for
    the Riemannian measures, a per-parameter `..._normalized`; on the
    epochs it skips the same keys hold NaN. Keras hands every callback the
    same `logs`, and the logger moves itself to the front of the list, so
    `TensorBoard` writes these keys as scalars
    (`epoch_riemannian_sharpness`, `epoch_hessian_trace_stderr`, ...)
    beside the loss and the step's own statistics (`sharpness_gap`,
    `grad_norm`, `grad_cosine`).

    The short modes log the Riemannian sharpness S_R with a diagonal Fisher
    metric and the Hessian trace; `--full` adds S_R with a K-FAC metric
    (`riemannian_sharpness_kfac`) and the largest Hessian eigenvalue.

    Here S_R and tr H come out exact, with stderr 0: with BatchNorm in
    inference mode this ReLU network is linear in each weight tensor on its
    own, so the part of H that the Gauss-Newton matrix misses has zero
    diagonal blocks, and only those enter these traces. A network with tanh
    or GELU activations gets a Hutchinson estimate of that part, and a
    positive stderr; `lambda_max` always has one.

    `ModelCheckpoint` saves the whole model to a `.keras` file every epoch:
    architecture, weights, the compile configuration and the optimizer's
    variables: the base SGD's momentum, `iterations`, LLQR's U and its
    refresh count.

    For preemptible jobs, add `keras.callbacks.BackupAndRestore(backup_dir)`:
    it saves the same state each epoch and, when `fit` is started again
    after a crash, restores it and skips the finished epochs by itself.
    Below we resume by hand instead, to show what comes back.
    """
    xp, yp = x[: size["n_probe"]], y[: size["n_probe"]]

    def callbacks():
        return [
            kg.callbacks.SharpnessLogger(
                xp, yp,
                metrics=size["metrics"],
                every_n_epochs=size["log_every"],
                num_probes=size["probes"],
                max_probes=size["probes"],  # a fixed budget: the stderr says how good it is
                verbose=1,
            ),
            keras.callbacks.TensorBoard(log_dir, write_graph=False),
            keras.callbacks.ModelCheckpoint(ckpt, save_freq="epoch"),
        ]

    epochs = size["epochs"]
    t0 = time.perf_counter()
    history = model.fit(x, y, batch_size=size["batch"], epochs=epochs, validation_data=(xt, yt),
                        callbacks=callbacks(), verbose=2)
    facts["fit_seconds"] = time.perf_counter() - t0
    h = history.history
    # Every metric comes with its standard error; the *_normalized keys are
    # S_R per parameter with nonzero Fisher.
    for key in [k for k in h if k.split("_stderr")[0] in size["metrics"]] + ["loss", "val_loss", "val_accuracy"]:
        print(f"{key:34s} " + "  ".join(f"{v:.4g}" for v in h[key]))
    facts["history"] = {k: [float(v) for v in vals] for k, vals in h.items()}
    steps_per_epoch = -(-len(x) // size["batch"])
    facts.update(steps_per_epoch=steps_per_epoch, epochs=epochs,
                 iterations=int(keras.ops.convert_to_numpy(optimizer.iterations)),
                 refreshes=int(keras.ops.convert_to_numpy(optimizer.refreshes)))
    print(f"after {epochs} epochs: {facts['iterations']} steps, {facts['refreshes']} U refreshes "
          f"(every {size['refresh_every']} steps)")
    # `refreshes` and `refresh_seconds` come from kg.callbacks.RefreshMonitor,
    # which fit adds by itself for LLQR optimizers: the time a refresh took
    # beyond an ordinary step (the first step's refresh compiles, so it is
    # counted but not timed).
    print(f"refreshes per epoch (logged): {h['refreshes']}, refresh seconds so far: "
          + ", ".join(f"{v:.2f}" for v in h["refresh_seconds"]))

    """
    ## Resume from the checkpoint

    `keras.saving.load_model` rebuilds the model and recompiles it from the
    saved configuration. Importing keras_geosam registers its optimizers,
    and a model saved with a keras_geosam two-pass optimizer comes back
    *attached*: no `kg.attach` call is needed after loading. (A keras-cv
    model also needs `import keras_cv` before loading, for its classes.)

    We check what came back: the same predictions, the same `iterations`,
    the same U and refresh count. Then training continues where it stopped:
    `initial_epoch` keeps the epoch numbering (and TensorBoard's x axis),
    and the next refresh falls due on the same step as in an uninterrupted
    run.
    """
    last = ckpt.format(epoch=epochs)
    resumed = keras.saving.load_model(last)
    ropt = resumed.optimizer
    probe = xt[:32]
    pred_trained = model.predict(probe, verbose=0)
    pred_gap = float(np.max(np.abs(pred_trained - resumed.predict(probe, verbose=0))))
    u_before, u_after = u_values(optimizer), u_values(ropt)
    u_gap = max(float(np.max(np.abs(a - b))) for a, b in zip(u_before, u_after))
    # U starts as identity K-FAC factors and unit diagonals; how far it moved
    # shows the refreshes did something (and the comparison above is not
    # identity against identity).
    u_moved = max(float(np.max(np.abs(a - np.eye(a.shape[0])))) if a.ndim == 2 and a.shape[0] == a.shape[1]
                  else float(np.max(np.abs(a - 1.0))) for a in u_after)
    facts.update(
        reload_optimizer=type(ropt).__name__,
        reload_structure=ropt.structure,
        reload_prediction_max_abs_diff=pred_gap,
        reload_iterations=int(keras.ops.convert_to_numpy(ropt.iterations)),
        reload_refreshes=int(keras.ops.convert_to_numpy(ropt.refreshes)),
        reload_u_count=len(u_after),
        reload_u_max_abs_diff=u_gap,
        u_distance_from_init=u_moved,
    )
    print(f"reloaded: {facts['reload_optimizer']}"
          f"(structure={facts['reload_structure']!r}), predictions differ by {pred_gap:.2e}, "
          f"iterations {facts['reload_iterations']}, refreshes {facts['reload_refreshes']}, "
          f"{len(u_after)} U tensors differ by {u_gap:.2e} (U moved {u_moved:.3g} from its initial value)")

    # `sharpness_gap` and `grad_cosine` in these logs come from the two-pass
    # step: the reloaded model is attached.
    t0 = time.perf_counter()
    more = resumed.fit(x, y, batch_size=size["batch"], initial_epoch=epochs, epochs=epochs + 1,
                       validation_data=(xt, yt), callbacks=callbacks(), verbose=2)
    facts["resume_fit_seconds"] = time.perf_counter() - t0
    facts.update(
        resumed_history={k: [float(v) for v in vals] for k, vals in more.history.items()},
        resumed_iterations=int(keras.ops.convert_to_numpy(ropt.iterations)),
        resumed_refreshes=int(keras.ops.convert_to_numpy(ropt.refreshes)),
        test_accuracy=float(more.history["val_accuracy"][-1]),
        log_dir=log_dir,
        checkpoints=[ckpt.format(epoch=e) for e in range(1, epochs + 2)],
    )
    print(f"resumed: iterations {facts['reload_iterations']} -> {facts['resumed_iterations']}, "
          f"refreshes {facts['reload_refreshes']} -> {facts['resumed_refreshes']}, "
          f"test accuracy {facts['test_accuracy']:.3f}")

    """
    On random images, with a few hundred examples and three epochs, the
    test accuracy means little: evaluation uses BatchNorm's running
    statistics, which have not settled yet (keras-cv's, with Keras' default
    momentum 0.99, even less). The short modes show the mechanics; `--full`
    gives CIFAR-10 numbers.

    ## What to try next

    - `--full` on a GPU: CIFAR-10, ResNet-20, 30 epochs; compare with
      `kg.optimizers.SAM(keras.optimizers.SGD(...), rho=0.05)` and plain SGD.
    - `structure="diagonal"` is cheaper per refresh than `"kfac"`.
    - `metrics=("riemannian_sharpness", "lambda_max", ...)`: see
      `kg.callbacks.SharpnessLogger.available()`.
    """
    facts["total_seconds"] = time.perf_counter() - start
    # Arrays for checking the checkpoints from outside (tests/guides/test_guide_resnet.py).
    np.savez(os.path.join(args.output, "state.npz"), probe=probe, pred_trained=pred_trained,
             pred_resumed=resumed.predict(probe, verbose=0),
             **{f"u_trained_{i}": u for i, u in enumerate(u_before)})
    path = os.path.join(args.output, "facts.json")
    with open(path, "w") as f:
        json.dump(facts, f, indent=1)
    print(f"facts: {path}; TensorBoard: tensorboard --logdir {log_dir}  ({facts['total_seconds']:.1f}s)")
    return facts


if __name__ == "__main__":
    main()
