"""Train an ordinary Keras CNN with Crossbow's SMA through model.fit (see docs/keras.md).

    python examples/keras_example.py [--epochs N] [--out model.keras]

Two lines differ from a plain Keras script: the strategy, and use_sma after compile.
"""
import argparse
import json

import crossbow_tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--out", default="sma_cnn.keras")
args = parser.parse_args()

# 8 learners: 2 logical CPU devices x 4 learners (on a GPU machine: learners_per_device only).
strategy = crossbow_tf.CrossbowStrategy(learners_per_device=4, logical_cpu_devices=2)   # extra line 1

import keras  # noqa: E402  (after the strategy: TensorFlow fixes its devices at first use)

from crossbow_tf.data.embedded import load_embedded_mnist  # noqa: E402

(x_train, y_train), (x_test, y_test) = load_embedded_mnist()   # 4,000 / 1,000 real MNIST digits
keras.utils.set_random_seed(0)

model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 5, activation="relu"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Conv2D(32, 5, activation="relu"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(10),
])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model = crossbow_tf.use_sma(model, strategy)                                              # extra line 2

# batch_size is the global batch per step (as under tf.distribute): 8 learners of 128 / 8 = 16 examples.
model.fit(x_train, y_train, batch_size=128, epochs=args.epochs, validation_data=(x_test, y_test), verbose=2)

loss, accuracy = model.evaluate(x_test, y_test, verbose=0)        # the central average model z
model.save(args.out)                                               # a plain Keras model file

reloaded = keras.models.load_model(args.out)                       # plain Keras, no crossbow_tf
reloaded_loss, reloaded_accuracy = reloaded.evaluate(x_test, y_test, verbose=0)
print(json.dumps({"test_accuracy": accuracy, "reloaded_test_accuracy": reloaded_accuracy,
                  "test_loss": loss, "reloaded_test_loss": reloaded_loss, "model": args.out}))
