"""K-FAC Riemannian sharpness of MobileNetV3Small, in gradients and memory.

The issue's case (every model family): ``keras.applications.
MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10)``,
``riemannian_sharpness(structure="kfac")`` on 16 images. Goals: within 50
gradients' time and 2 GB of peak memory on every backend.

Each backend runs in a process of its own (``--backends``). In it: a
compiled loss-and-gradient of the 16 images is timed warm (median of 5);
one S_R call runs cold (its compilations included) and a second warm, each
timed; the peak resident set is read after each (``ru_maxrss``) and
reported as growth over the process's set once the model is built and one
gradient has run.

    python bench/mobilenet_sharpness.py                     # every backend
    python bench/mobilenet_sharpness.py --backends torch --json out.json
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(num_images, num_probes):
    import resource
    import time
    import warnings

    import keras
    import numpy as np

    import keras_geosam as kg

    def rss_gb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GB (Linux)

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10)
    model.compile(loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(num_images, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=num_images)
    kg.curvature.loss_and_gradient(model, x, y)
    base = rss_gb()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        value, grads = kg.curvature.loss_and_gradient(model, x, y)
        keras.ops.convert_to_numpy(grads[0])
        times.append(time.perf_counter() - t0)
    grad_s = float(np.median(times))
    out = {"backend": keras.backend.backend(), "images": num_images, "probes": num_probes, "gradient_s": grad_s,
           "params": int(sum(np.prod(v.shape) for v in model.trainable_variables))}
    for label in ("cold", "warm"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            est = kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", num_probes=num_probes, rtol=None)
            seconds = time.perf_counter() - t0
        out[label] = {"seconds": seconds, "gradients": seconds / grad_s, "peak_growth_gb": rss_gb() - base,
                      "value": est.value, "stderr": est.stderr}
    out["rss_base_gb"] = base
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="tensorflow,jax,torch")
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.images, args.probes)), flush=True)
        return
    rows = []
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        proc = subprocess.run([sys.executable, __file__, "--child", "--images", str(args.images), "--probes", str(args.probes)],
                              env=env, capture_output=True, text=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(f"{backend}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(line[0][len("RESULT "):])
        rows.append(row)
        for label in ("cold", "warm"):
            r = row[label]
            print(f"{backend:10s} {label}: {r['seconds']:.1f} s = {r['gradients']:.1f} gradients "
                  f"(a gradient {row['gradient_s']:.3f} s), peak growth {r['peak_growth_gb']:.2f} GB "
                  f"(process {row['rss_base_gb']:.2f} GB before), S_R {r['value']:.4g} +- {r['stderr']:.2g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
