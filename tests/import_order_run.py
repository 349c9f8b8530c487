"""Issue 43's eight variants: a small CNN (Conv2D or Conv1D) under float32 and mixed_bfloat16 trained
with use_sma's two lines, in a fresh interpreter that imports keras or crossbow_tf first (argv[1]).
Prints, per variant, the learners' computation and the forms its convolutions took, or the one-line
refusal before training, and whether the epoch's loss is finite; then the convolution forms the probe
chooses in this process."""
import sys

if sys.argv[1] == "keras":
    import keras
    import crossbow_tf
else:
    import crossbow_tf
    import keras
import numpy as np  # noqa: E402

from crossbow_tf.distribute.devices import split_cpu  # noqa: E402

devices = split_cpu(2)
rng = np.random.default_rng(0)
for layer in ("Conv2D", "Conv1D"):
    shape = (10, 10, 2) if layer == "Conv2D" else (20, 3)
    x = rng.random((32,) + shape, dtype=np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    for policy in ("float32", "mixed_bfloat16"):
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(0)
        inputs = keras.Input(shape)
        h = getattr(keras.layers, layer)(4, 3, activation="relu")(inputs)
        h = keras.layers.Flatten()(h)
        model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(h))
        keras.mixed_precision.set_global_policy("float32")
        model.compile(keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        try:
            crossbow_tf.use_sma(model, crossbow_tf.CrossbowStrategy(devices=devices, learners_per_device=2))
            history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        except ValueError as e:
            print(f"{layer} {policy} refused: {e}")
            continue
        computation = crossbow_tf.keras.sma.get_training(model).engine.learner_computation
        forms = sorted({form for form, _ in getattr(computation, "conv_forms", {}).values()})
        print(f"{layer} {policy} {type(computation).__name__} {','.join(forms) or '-'} "
              f"{np.isfinite(history.history['loss'][0])}")
# The probe's choice and why the grouped form does not compute, plain and dilated (tests/test_conv_forms.py).
from crossbow_tf.engine import conv_forms  # noqa: E402
for dtype in ("float32", "bfloat16"):
    print("choice", dtype, conv_forms.choose(dtype, "CPU")[0], "grouped:", conv_forms.why_not("CPU", dtype, "grouped"))
    print("choice", dtype + "-dilated", conv_forms.choose(dtype, "CPU", dilated=True)[0])
