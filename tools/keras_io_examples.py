"""keras-io's scripts run in plain Keras and with use_sma's two lines, step by step, side by side.

    python tools/keras_io_examples.py                 # all four scripts, every step, their own optimizers
    python tools/keras_io_examples.py --short         # CI's form (tests/test_keras_io_examples.py)
    python tools/keras_io_examples.py --scripts mnist_convnet antirectifier --seed 1
    python tools/keras_io_examples.py --learning-rate-scale 2   # use_sma(..., learning_rate_scale=2)
    python tools/keras_io_examples.py --sgd           # every optimizer line swapped for momentum SGD
    python tools/keras_io_examples.py --noise-matching off   # use_sma(..., noise_matching=False)
    python tools/keras_io_examples.py --scripts text_classification_with_transformer bidirectional_lstm_imdb \
        --learners-per-device 4 --nlp-reviews 4000 --nlp-maxlen 40 --require-within 3 --require-fused
                                                      # .ci/run's check of issue 26 (the two NLP scripts)
    python tools/keras_io_examples.py --scripts custom_train_step knowledge_distillation variational_autoencoder \
        --require-within 3                            # issue 44: training logic of the model's own

The last three (keras-io's guides/custom_train_step_in_tensorflow.py, examples/vision/knowledge_distillation.py
and examples/generative/vae.py, in their Keras 3 forms) override train_step, compute_loss and test_step;
the guide's GAN, whose train_step steps two optimizers of its own, is refused by use_sma by design, and
--require-within checks that it is, in one line. Where a script has no accuracy (the guide's random
regression, the VAE) --require-within compares the final training losses: SMA's at most --loss-within
percent (default 5) above plain Keras's.

The scripts are keras-team/keras-io's examples/vision/mnist_convnet.py,
examples/keras_recipes/antirectifier.py, guides/writing_your_own_callbacks.py and
guides/training_with_built_in_methods.py, transcribed step by step with their own optimizers
(Adam, RMSprop), learning rates and batch sizes. What differs from them:
- the data: the embedded digits (crossbow_tf.data.load_embedded_mnist, 4,000 / 1,000 real MNIST
  digits) instead of keras.datasets.mnist, shaped as each script shapes its data;
- fewer epochs (and steps_per_epoch=10 where the guide runs 100 steps of 64 examples, more than the
  embedded digits hold);
- the two lines: the strategy right after the imports (2 logical CPU devices x 2 learners, so
  k = 4 and the scripts' batches of 64 and 128 give learners 16 and 32 examples), and
  `model = sma(model)` after every compile, which is use_sma in the SMA run and nothing in the
  plain Keras run. Both runs share the process (and so its 2 logical devices).
The callbacks guide's RMSprop(0.1) on its linear regression (and, with --sgd, its schedule's 0.05)
may not converge in either run: the comparison there is of the hooks and their logs, not of the
losses. A step that fails in plain Keras 3 (the guide's add_metric, removed in Keras 3;
ModelCheckpoint paths without the .keras suffix that Keras 3 requires) fails with SMA too and is
not counted. docs/keras.md has the accuracies, and why SMA with Adam/RMSprop needs noise matching
(use_sma's default for them) to keep up with plain Keras.

    python tools/keras_io_examples.py --scripts mnist_convnet antirectifier training_with_built_in_methods \
        --only "end-to-end example" --require-within 3     # .ci/run's check of issue 18's 3 points

exits 1, naming the script, when a step that runs in plain Keras fails with SMA or SMA's test
accuracy is more than the given points below plain Keras's.

Prints a table of every step's outcome and time in both runs and the test accuracies, then one
JSON line with all of it (and with --require-within, one line saying whether it holds).
"""
import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_tf  # noqa: E402
import crossbow_tf.algorithms  # noqa: E402


def _learners_per_device(argv):
    # Read before the strategy line, which must come right after the imports (main() parses the rest).
    return int(argv[argv.index("--learners-per-device") + 1]) if "--learners-per-device" in argv else 2


strategy = crossbow_tf.CrossbowStrategy(learners_per_device=_learners_per_device(sys.argv),   # extra line 1
                                        logical_cpu_devices=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers  # noqa: E402

from crossbow_tf.data import load_embedded_mnist  # noqa: E402

# Each script's own optimizer line (keras-io's), per script and, in the built-in methods guide, per
# step where the guide compiles with another one.
OWN_OPTIMIZERS = {
    "mnist_convnet": lambda: "adam",
    "antirectifier": lambda: keras.optimizers.RMSprop(),
    "callbacks": lambda: keras.optimizers.RMSprop(learning_rate=0.1),
    "built_in_methods": lambda: keras.optimizers.RMSprop(learning_rate=1e-3),
    "built_in_methods adam": lambda: keras.optimizers.Adam(),
    "text_classification_with_transformer": lambda: "adam",
    "bidirectional_lstm_imdb": lambda: "adam",
}
# --sgd: the variant this tool ran before use_sma took Keras's other optimizers, every optimizer line
# swapped for momentum SGD at a rate that trains both runs (kept to compare with the figures of then).
SGD_OPTIMIZERS = {
    "mnist_convnet": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "antirectifier": lambda: keras.optimizers.SGD(0.02, momentum=0.9),
    "callbacks": lambda: keras.optimizers.SGD(0.01),
    "built_in_methods": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "built_in_methods adam": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "text_classification_with_transformer": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "bidirectional_lstm_imdb": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}
OPTIMIZERS = dict(OWN_OPTIMIZERS)


class Steps:
    """Runs a script's steps, recording which raised (and why) instead of stopping at the first.

    ``with step(name): ...`` runs a step; ``step.wanted(name)`` says whether the short form runs it."""

    def __init__(self, short=False, only=None):
        self.short, self.only = short, only
        self.outcome, self.accuracy, self.seconds = {}, {}, {}
        self.replicated_notices = []    # the engine's "learners run replicated" lines, as logged

    def wanted(self, name):
        if self.only is not None:
            return name in self.only
        return not self.short or name not in LEFT_OUT_OF_SHORT_FORM

    def cut(self, x, y):
        """The short form's training data: the first SHORT_FORM_EXAMPLES."""
        return x[:SHORT_FORM_EXAMPLES], y[:SHORT_FORM_EXAMPLES]

    @contextlib.contextmanager
    def __call__(self, name):
        start = time.perf_counter()
        try:
            yield
            self.outcome[name] = "ok"
        except Exception as error:   # noqa: BLE001  (a failing step is an outcome to compare)
            self.outcome[name] = "".join(traceback.format_exception_only(type(error), error)).strip()[:500]
        self.seconds[name] = time.perf_counter() - start


# Steps the short form (CI) leaves out, to keep CI short: every new model costs its first step's
# trace (2.5-4 s here with SMA). Each repeats what another step runs (the callbacks guide's "logs
# dict" and "early stopping" call the hooks the other two call), or has its own tests against plain
# Keras: multi-input models (tests/test_keras_models.py), EarlyStopping (test_keras_callbacks.py),
# custom and add_loss losses and the weights (test_keras_conventions.py), tf.data (test_keras_data.py).
LEFT_OUT_OF_SHORT_FORM = {"custom Loss class", "custom metric", "tf.data with steps_per_epoch", "validation_steps",
                          "multi-output: loss_weights and a dataset of dicts", "validation dataset", "validation_split",
                          "class_weight", "sample_weight", "dataset with sample weights", "custom loss function",
                          "multi-input, multi-output: lists and dicts", "EarlyStopping", "logs dict",
                          "early stopping at minimum loss", "add_loss in a layer", "tf.data",
                          # tests/test_keras_hooks.py compares these with plain Keras in their own right
                          "lower-level: own loss and trackers, no compiled loss", "own test_step in evaluate"}
# The short form of the scripts with training logic of their own: this many examples (rows, digits).
HOOKS_SHORT_EXAMPLES = 512
# The short form trains mnist_convnet and antirectifier 1 epoch on this many digits (of 4,000).
SHORT_FORM_EXAMPLES = 2048


def mnist_convnet(sma, step):
    num_classes = 10
    input_shape = (28, 28, 1)
    (x_train, y_train), (x_test, y_test) = load_embedded_mnist()   # already float32 (N, 28, 28, 1) in [0, 1]
    y_train = keras.utils.to_categorical(y_train, num_classes)
    y_test = keras.utils.to_categorical(y_test, num_classes)
    with step("build"):
        model = keras.Sequential([
            keras.Input(shape=input_shape),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax"),
        ])
        model.summary()
    batch_size = 128
    epochs = 3
    if step.short:
        (x_train, y_train), epochs = step.cut(x_train, y_train), 1
    with step("compile and fit"):
        model.compile(loss="categorical_crossentropy", optimizer=OPTIMIZERS["mnist_convnet"](), metrics=["accuracy"])
        model = sma(model)
        model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1, verbose=0)
    with step("evaluate"):
        score = model.evaluate(x_test, y_test, verbose=0)
        step.accuracy["test"] = score[1]


class Antirectifier(layers.Layer):
    def __init__(self, initializer="he_normal", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        output_dim = input_shape[-1]
        self.kernel = self.add_weight(shape=(output_dim * 2, output_dim), initializer=self.initializer,
                                      name="kernel", trainable=True)

    def call(self, inputs):
        inputs -= tf.reduce_mean(inputs, axis=-1, keepdims=True)
        pos = tf.nn.relu(inputs)
        neg = tf.nn.relu(-inputs)
        concatenated = tf.concat([pos, neg], axis=-1)
        mixed = tf.matmul(concatenated, self.kernel)
        return mixed

    def get_config(self):
        base_config = super().get_config()
        config = {"initializer": keras.initializers.serialize(self.initializer)}
        return dict(list(base_config.items()) + list(config.items()))


def antirectifier(sma, step):
    batch_size = 128
    epochs = 2
    (x_train, y_train), (x_test, y_test) = load_embedded_mnist()
    x_train = x_train.reshape(-1, 784)
    x_test = x_test.reshape(-1, 784)
    if step.short:
        (x_train, y_train), epochs = step.cut(x_train, y_train), 1
    with step("build, compile and fit"):
        model = keras.Sequential([
            keras.Input(shape=(784,)),
            layers.Dense(256),
            Antirectifier(),
            layers.Dense(256),
            Antirectifier(),
            layers.Dropout(0.5),
            layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=OPTIMIZERS["antirectifier"](),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()])
        model = sma(model)
        model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.15, verbose=0)
    with step("evaluate"):
        step.accuracy["test"] = model.evaluate(x_test, y_test, verbose=0)[1]


def writing_your_own_callbacks(sma, step):
    calls = step.accuracy.setdefault("calls", {})      # per step: every hook called, with its log keys
    record = {}

    def log(*entry):
        record["to"].append(entry)

    def get_model():
        model = keras.Sequential()
        model.add(keras.layers.Dense(1, input_dim=784))
        model.compile(optimizer=OPTIMIZERS["callbacks"](), loss="mean_squared_error",
                      metrics=["mean_absolute_error"])
        return sma(model)

    (x_train, y_train), (x_test, y_test) = load_embedded_mnist()
    x_train = x_train.reshape(-1, 784)
    x_test = x_test.reshape(-1, 784)
    x_train, y_train, x_test, y_test = x_train[:1000], y_train[:1000], x_test[:1000], y_test[:1000]

    class CustomCallback(keras.callbacks.Callback):
        def _log(self, hook, logs):
            log(hook, tuple(sorted((logs or {}).keys())))

    for hook in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin",
                 "on_test_end", "on_predict_begin", "on_predict_end", "on_train_batch_begin", "on_train_batch_end",
                 "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end"):
        setattr(CustomCallback, hook, (lambda name: lambda self, *args, logs=None: self._log(name, logs))(hook))

    with step("basic example"):
        record["to"] = calls["basic example"] = []
        model = get_model()
        model.fit(x_train, y_train, batch_size=128, epochs=1, verbose=0, validation_split=0.5,
                  callbacks=[CustomCallback()])
        model.evaluate(x_test, y_test, batch_size=128, verbose=0, callbacks=[CustomCallback()])
        model.predict(x_test, batch_size=128, callbacks=[CustomCallback()], verbose=0)

    class LossAndErrorPrintingCallback(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            log("loss", logs["loss"])

        def on_test_batch_end(self, batch, logs=None):
            log("test loss", logs["loss"])

        def on_epoch_end(self, epoch, logs=None):
            log("epoch", logs["loss"], logs["mean_absolute_error"])

    if step.wanted("logs dict"):
        with step("logs dict"):
            record["to"] = calls["logs dict"] = []
            model = get_model()
            model.fit(x_train, y_train, batch_size=128, epochs=2, verbose=0, callbacks=[LossAndErrorPrintingCallback()])
            model.evaluate(x_test, y_test, batch_size=128, verbose=0, callbacks=[LossAndErrorPrintingCallback()])

    class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
        def __init__(self, patience=0):
            super().__init__()
            self.patience = patience
            self.best_weights = None

        def on_train_begin(self, logs=None):
            self.wait = 0
            self.stopped_epoch = 0
            self.best = np.inf          # the guide's np.Inf, gone in NumPy 2

        def on_epoch_end(self, epoch, logs=None):
            current = logs.get("loss")
            if np.less(current, self.best):
                self.best = current
                self.wait = 0
                self.best_weights = self.model.get_weights()
            else:
                self.wait += 1
                if self.wait >= self.patience:
                    self.stopped_epoch = epoch
                    self.model.stop_training = True
                    self.model.set_weights(self.best_weights)

        def on_train_end(self, logs=None):
            log("stopped", self.stopped_epoch)

    if step.wanted("early stopping at minimum loss"):
        with step("early stopping at minimum loss"):
            record["to"] = []             # when it stops depends on the losses, which differ
            model = get_model()
            model.fit(x_train, y_train, batch_size=64, steps_per_epoch=5, epochs=30, verbose=0,
                      callbacks=[LossAndErrorPrintingCallback(), EarlyStoppingAtMinLoss()])

    class CustomLearningRateScheduler(keras.callbacks.Callback):
        def __init__(self, schedule):
            super().__init__()
            self.schedule = schedule

        def on_epoch_begin(self, epoch, logs=None):
            if not hasattr(self.model.optimizer, "learning_rate"):
                raise ValueError('Optimizer must have a "learning_rate" attribute.')
            lr = float(self.model.optimizer.learning_rate)
            scheduled_lr = self.schedule(epoch, lr)
            self.model.optimizer.learning_rate = scheduled_lr
            log("lr", epoch, scheduled_lr)

    LR_SCHEDULE = [(3, 0.05), (6, 0.01), (9, 0.005), (12, 0.001)]

    def lr_schedule(epoch, lr):
        if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
            return lr
        for i in range(len(LR_SCHEDULE)):
            if epoch == LR_SCHEDULE[i][0]:
                return LR_SCHEDULE[i][1]
        return lr

    with step("learning rate scheduling"):
        record["to"] = calls["learning rate scheduling"] = []
        model = get_model()
        model.fit(x_train, y_train, batch_size=64, steps_per_epoch=5, epochs=15, verbose=0,
                  callbacks=[LossAndErrorPrintingCallback(), CustomLearningRateScheduler(lr_schedule)])


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(tf.reduce_sum(inputs) * 0.1)
        return inputs


class MetricLoggingLayer(layers.Layer):
    def call(self, inputs):
        self.add_metric(keras.backend.std(inputs), name="std_of_activation", aggregation="mean")
        return inputs


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_fn = keras.metrics.BinaryAccuracy()

    def call(self, targets, logits, sample_weights=None):
        loss = self.loss_fn(targets, logits, sample_weights)
        self.add_loss(loss)
        acc = self.accuracy_fn(targets, logits, sample_weights)
        self.add_metric(acc, name="accuracy")
        return tf.nn.softmax(logits)


class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse"):
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = tf.math.reduce_mean(tf.square(y_true - y_pred))
        reg = tf.math.reduce_mean(tf.square(0.5 - y_pred))
        return mse + reg * self.regularization_factor


class CategoricalTruePositives(keras.metrics.Metric):
    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = tf.reshape(tf.argmax(y_pred, axis=1), shape=(-1, 1))
        values = tf.cast(y_true, "int32") == tf.cast(y_pred, "int32")
        values = tf.cast(values, "float32")
        if sample_weight is not None:
            sample_weight = tf.cast(sample_weight, "float32")
            values = tf.multiply(values, sample_weight)
        self.true_positives.assign_add(tf.reduce_sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


def training_with_built_in_methods(sma, step, workdir):
    optimizer = OPTIMIZERS["built_in_methods"]
    (x_train, y_train), (x_test, y_test) = load_embedded_mnist()
    x_train = x_train.reshape(-1, 784)
    x_test = x_test.reshape(-1, 784)
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")
    # Reserve 1,000 of the 4,000 samples for validation (the guide: 10,000 of 60,000).
    x_val, y_val = x_train[-1000:], y_train[-1000:]
    x_train, y_train = x_train[:-1000], y_train[:-1000]

    def get_uncompiled_model():
        inputs = keras.Input(shape=(784,), name="digits")
        x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
        x = layers.Dense(64, activation="relu", name="dense_2")(x)
        outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
        return keras.Model(inputs=inputs, outputs=outputs)

    def get_compiled_model():
        model = get_uncompiled_model()
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy"])
        return sma(model)

    if step.wanted("end-to-end example"):
        with step("end-to-end example"):
            model = get_uncompiled_model()
            model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(),
                          metrics=[keras.metrics.SparseCategoricalAccuracy()])
            model = sma(model)
            history = model.fit(x_train, y_train, batch_size=64, epochs=1 if step.short else 2,
                                validation_data=(x_val, y_val), verbose=0)
            assert set(history.history) == {"loss", "sparse_categorical_accuracy", "val_loss",
                                            "val_sparse_categorical_accuracy"}
            results = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
            step.accuracy["test"] = results[1]
            assert model.predict(x_test[:3], verbose=0).shape == (3, 10)

    def custom_mean_squared_error(y_true, y_pred):
        return tf.math.reduce_mean(tf.square(y_true - y_pred))

    y_train_one_hot = tf.one_hot(y_train, depth=10)
    if step.wanted("custom loss function"):
        with step("custom loss function"):
            model = get_uncompiled_model()
            model.compile(optimizer=OPTIMIZERS["built_in_methods adam"](), loss=custom_mean_squared_error)
            model = sma(model)
            model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1, verbose=0)
    if step.wanted("custom Loss class"):
        with step("custom Loss class"):
            model = get_uncompiled_model()
            model.compile(optimizer=OPTIMIZERS["built_in_methods adam"](), loss=CustomMSE())
            model = sma(model)
            model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1, verbose=0)
    if step.wanted("custom metric"):
        with step("custom metric"):
            model = get_uncompiled_model()
            model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(),
                          metrics=[CategoricalTruePositives()])
            model = sma(model)
            model.fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)

    def regularised(middle):
        inputs = keras.Input(shape=(784,), name="digits")
        x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
        x = middle()(x)
        x = layers.Dense(64, activation="relu", name="dense_2")(x)
        outputs = layers.Dense(10, name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return sma(model)

    if step.wanted("add_loss in a layer"):
        with step("add_loss in a layer"):
            regularised(ActivityRegularizationLayer).fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)
    if step.wanted("add_metric in a layer"):
        with step("add_metric in a layer"):
            regularised(MetricLoggingLayer).fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)
    if step.wanted("model.add_loss and add_metric"):
        with step("model.add_loss and add_metric"):
            inputs = keras.Input(shape=(784,), name="digits")
            x1 = layers.Dense(64, activation="relu", name="dense_1")(inputs)
            x2 = layers.Dense(64, activation="relu", name="dense_2")(x1)
            outputs = layers.Dense(10, name="predictions")(x2)
            model = keras.Model(inputs=inputs, outputs=outputs)
            model.add_loss(tf.reduce_sum(x1) * 0.1)
            model.add_metric(keras.backend.std(x1), name="std_of_activation", aggregation="mean")
            model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model = sma(model)
            model.fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)
    if step.wanted("compiled without a loss (LogisticEndpoint)"):
        with step("compiled without a loss (LogisticEndpoint)"):
            inputs = keras.Input(shape=(3,), name="inputs")
            targets = keras.Input(shape=(10,), name="targets")
            logits = keras.layers.Dense(10)(inputs)
            predictions = LogisticEndpoint(name="predictions")(logits, targets)
            model = keras.Model(inputs=[inputs, targets], outputs=predictions)
            model.compile(optimizer=OPTIMIZERS["built_in_methods adam"]())
            model = sma(model)
            data = {"inputs": np.random.random((3, 3)), "targets": np.random.random((3, 10))}
            model.fit(data, verbose=0)
    if step.wanted("validation_split"):
        with step("validation_split"):
            get_compiled_model().fit(x_train, y_train, batch_size=64, validation_split=0.2, epochs=1, verbose=0)

    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(buffer_size=1024).batch(64)
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(64)
    val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(64)
    if step.wanted("tf.data"):
        with step("tf.data"):
            model = get_compiled_model()
            model.fit(train_dataset, epochs=1, verbose=0)
            model.evaluate(test_dataset, verbose=0)
    if step.wanted("tf.data with steps_per_epoch"):
        with step("tf.data with steps_per_epoch"):
            get_compiled_model().fit(train_dataset, epochs=3, steps_per_epoch=10, verbose=0)
    if step.wanted("validation dataset"):
        with step("validation dataset"):
            get_compiled_model().fit(train_dataset, epochs=1, validation_data=val_dataset, verbose=0)
    if step.wanted("validation_steps"):
        with step("validation_steps"):
            get_compiled_model().fit(train_dataset, epochs=1, validation_data=val_dataset, validation_steps=10,
                                     verbose=0)

    class_weight = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: 1.0, 7: 1.0, 8: 1.0, 9: 1.0}
    if step.wanted("class_weight"):
        with step("class_weight"):
            get_compiled_model().fit(x_train, y_train, class_weight=class_weight, batch_size=64, epochs=1, verbose=0)
    sample_weight = np.ones(shape=(len(y_train),))
    sample_weight[y_train == 5] = 2.0
    if step.wanted("sample_weight"):
        with step("sample_weight"):
            get_compiled_model().fit(x_train, y_train, sample_weight=sample_weight, batch_size=64, epochs=1, verbose=0)
    if step.wanted("dataset with sample weights"):
        with step("dataset with sample weights"):
            weighted = tf.data.Dataset.from_tensor_slices((x_train, y_train, sample_weight))
            get_compiled_model().fit(weighted.shuffle(buffer_size=1024).batch(64), epochs=1, verbose=0)

    image_input = keras.Input(shape=(32, 32, 3), name="img_input")
    timeseries_input = keras.Input(shape=(None, 10), name="ts_input")
    x1 = layers.GlobalMaxPooling2D()(layers.Conv2D(3, 3)(image_input))
    x2 = layers.GlobalMaxPooling1D()(layers.Conv1D(3, 3)(timeseries_input))
    x = layers.concatenate([x1, x2])
    score_output = layers.Dense(1, name="score_output")(x)
    class_output = layers.Dense(5, name="class_output")(x)
    img_data = np.random.random_sample(size=(100, 32, 32, 3))
    ts_data = np.random.random_sample(size=(100, 20, 10))
    score_targets = np.random.random_sample(size=(100, 1))
    class_targets = np.random.random_sample(size=(100, 5))
    if step.wanted("multi-input, multi-output: lists and dicts"):
        with step("multi-input, multi-output: lists and dicts"):
            model = keras.Model(inputs=[image_input, timeseries_input], outputs=[score_output, class_output])
            model.compile(optimizer=optimizer(),
                          loss=[keras.losses.MeanSquaredError(), keras.losses.CategoricalCrossentropy()],
                          metrics=[[keras.metrics.MeanAbsolutePercentageError(), keras.metrics.MeanAbsoluteError()],
                                   [keras.metrics.CategoricalAccuracy()]])
            model = sma(model)
            model.fit([img_data, ts_data], [score_targets, class_targets], batch_size=32, epochs=1, verbose=0)
            model.fit({"img_input": img_data, "ts_input": ts_data},
                      {"score_output": score_targets, "class_output": class_targets}, batch_size=32, epochs=1, verbose=0)
    if step.wanted("multi-output: loss_weights and a dataset of dicts"):
        with step("multi-output: loss_weights and a dataset of dicts"):
            model = keras.Model(inputs=[image_input, timeseries_input], outputs=[score_output, class_output])
            model.compile(optimizer=optimizer(),
                          loss={"score_output": keras.losses.MeanSquaredError(),
                                "class_output": keras.losses.CategoricalCrossentropy()},
                          loss_weights={"score_output": 2.0, "class_output": 1.0})
            model = sma(model)
            train = tf.data.Dataset.from_tensor_slices(
                ({"img_input": img_data, "ts_input": ts_data},
                 {"score_output": score_targets, "class_output": class_targets})).shuffle(buffer_size=1024).batch(64)
            model.fit(train, epochs=1, verbose=0)

    if step.wanted("EarlyStopping"):
        with step("EarlyStopping"):
            callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=2, verbose=0)]
            get_compiled_model().fit(x_train, y_train, epochs=3, batch_size=64, callbacks=callbacks,
                                     validation_split=0.2, verbose=0)
    if step.wanted("ModelCheckpoint without the .keras suffix"):
        with step("ModelCheckpoint without the .keras suffix"):
            callbacks = [keras.callbacks.ModelCheckpoint(filepath=os.path.join(workdir, "mymodel_{epoch}"),
                                                         save_best_only=True, monitor="val_loss")]
            get_compiled_model().fit(x_train, y_train, epochs=2, batch_size=64, callbacks=callbacks,
                                     validation_split=0.2, verbose=0)
    if step.wanted("ModelCheckpoint every 100 batches, restored"):
        with step("ModelCheckpoint every 100 batches, restored"):
            checkpoint_dir = os.path.join(workdir, "ckpt")
            os.makedirs(checkpoint_dir, exist_ok=True)
            callbacks = [keras.callbacks.ModelCheckpoint(filepath=checkpoint_dir + "/ckpt-loss={loss:.2f}",
                                                         save_freq=100)]
            get_compiled_model().fit(x_train, y_train, epochs=1, callbacks=callbacks, verbose=0)
    if step.wanted("a schedule in the optimizer"):
        with step("a schedule in the optimizer"):
            lr_schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100000, decay_rate=0.96,
                                                                      staircase=True)
            keras.optimizers.SGD(learning_rate=lr_schedule)
    if step.wanted("TensorBoard callback"):
        with step("TensorBoard callback"):
            keras.callbacks.TensorBoard(log_dir=os.path.join(workdir, "logs"), histogram_freq=0, embeddings_freq=0,
                                        update_freq="epoch")


# The two NLP scripts (keras-io's examples/nlp/text_classification_with_transformer.py and
# examples/nlp/bidirectional_lstm_imdb.py) read keras.datasets.imdb.load_data(num_words=20000);
# here the same call's offline stand-in (crossbow_tf.data.synthetic_imdb: IMDB's ids and shapes, a
# learnable sentiment rule). Full form: 2,000 / 1,000 reviews and 2 epochs (the scripts' own count);
# short form: 256 reviews of at most 40 words, 1 epoch.
# --nlp-reviews N and --nlp-maxlen L set the full form's size instead (CI's keras-io step: fewer, shorter
# reviews, the scripts' models, optimizers, batch size and 2 epochs unchanged).
NLP_FULL_REVIEWS, NLP_SHORT_REVIEWS, NLP_SHORT_MAXLEN = 2000, 256, 40
NLP_SIZE = {"reviews": None, "maxlen": None}


def _imdb(step, num_words, maxlen):
    from crossbow_tf.data.synthetic_imdb import load_synthetic_imdb
    count = NLP_SHORT_REVIEWS if step.short else NLP_SIZE["reviews"] or NLP_FULL_REVIEWS
    maxlen = min(maxlen, NLP_SHORT_MAXLEN) if step.short else min(maxlen, NLP_SIZE["maxlen"] or maxlen)
    (x_train, y_train), (x_val, y_val) = load_synthetic_imdb(num_words=num_words, train_size=count,
                                                             test_size=count // 2)
    return (keras.utils.pad_sequences(x_train, maxlen=maxlen), y_train,
            keras.utils.pad_sequences(x_val, maxlen=maxlen), y_val, maxlen)


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = keras.ops.shape(x)[-1]
        positions = keras.ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def text_classification_with_transformer(sma, step):
    vocab_size = 20000
    maxlen = 200
    x_train, y_train, x_val, y_val, maxlen = _imdb(step, vocab_size, maxlen)
    embed_dim, num_heads, ff_dim = 32, 2, 32
    with step("build"):
        inputs = layers.Input(shape=(maxlen,))
        embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        x = embedding_layer(inputs)
        transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        x = transformer_block(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dropout(0.1)(x)
        x = layers.Dense(20, activation="relu")(x)
        x = layers.Dropout(0.1)(x)
        outputs = layers.Dense(2, activation="softmax")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
    with step("compile and fit"):
        model.compile(optimizer=OPTIMIZERS["text_classification_with_transformer"](),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model = sma(model)
        model.fit(x_train, y_train, batch_size=32, epochs=1 if step.short else 2, validation_data=(x_val, y_val),
                  verbose=0)
    with step("evaluate"):
        step.accuracy["test"] = model.evaluate(x_val, y_val, verbose=0)[1]


def bidirectional_lstm_imdb(sma, step):
    max_features = 20000
    maxlen = 200
    with step("build"):
        inputs = keras.Input(shape=(None,), dtype="int32")
        x = layers.Embedding(max_features, 128)(inputs)
        x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
        x = layers.Bidirectional(layers.LSTM(64))(x)
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)
    x_train, y_train, x_val, y_val, maxlen = _imdb(step, max_features, maxlen)
    with step("compile and fit"):
        model.compile(optimizer=OPTIMIZERS["bidirectional_lstm_imdb"](), loss="binary_crossentropy",
                      metrics=["accuracy"])
        model = sma(model)
        model.fit(x_train, y_train, batch_size=32, epochs=1 if step.short else 2, validation_data=(x_val, y_val),
                  verbose=0)
    with step("evaluate"):
        step.accuracy["test"] = model.evaluate(x_val, y_val, verbose=0)[1]


# ---- Keras hooks of the model's own (issue 44): train_step, compute_loss, test_step ----------------
# Transcribed from keras-io's guides/custom_train_step_in_tensorflow.py ("Customizing what happens in
# fit()"), examples/vision/knowledge_distillation.py and examples/generative/vae.py (their Keras 3
# forms), on the guide's own random regression data and the embedded digits.
def _custom_fit_data(rng):
    return rng.random((1000, 32)), rng.random((1000, 1)), rng.random((1000, 1))


def _dense_regression(cls):
    inputs = keras.Input(shape=(32,))
    return cls(inputs, keras.layers.Dense(1)(inputs))


def _final_loss(step, name, history, key="loss", checked=True):
    """Records the last epoch's KEY of HISTORY as NAME: a loss --loss-within compares (CHECKED), or a
    term of one that is only reported."""
    step.accuracy.setdefault("loss" if checked else "terms", {})[name] = float(history.history[key][-1])


class FitWithOwnStep(keras.Model):
    """The guide's first example: the compiled loss through self.compute_loss, the compiled metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, trainable_vars), trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class FitLowerLevel(keras.Model):
    """The guide's "going lower-level": its own loss and trackers, compiled with an optimizer only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, trainable_vars), trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class FitWeighted(keras.Model):
    """The guide's sample_weight section: the step unpacks a third element when fit passes one."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, trainable_vars), trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class EvaluateWithOwnStep(FitWithOwnStep):
    """The guide's own evaluation step (here on a model that trains with its own step too)."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    """The guide's end-to-end GAN, in small: one optimizer each for the discriminator and the generator."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        latent = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(latent), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        latent = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def custom_train_step(sma, step):
    rng = np.random.default_rng(0)
    x, y, sw = _custom_fit_data(rng)
    if step.short:
        x, y, sw = x[:HOOKS_SHORT_EXAMPLES], y[:HOOKS_SHORT_EXAMPLES], sw[:HOOKS_SHORT_EXAMPLES]
    epochs = 1 if step.short else 3
    with step("train_step with compute_loss and compiled metrics"):
        model = _dense_regression(FitWithOwnStep)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        model = sma(model)
        _final_loss(step, "train_step", model.fit(x, y, epochs=epochs, verbose=0))
    if step.wanted("lower-level: own loss and trackers, no compiled loss"):
        _lower_level(sma, step, x, y)
    with step("sample_weight through the own train_step"):
        model = _dense_regression(FitWeighted)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        model = sma(model)
        _final_loss(step, "sample_weight", model.fit(x, y, sample_weight=sw, epochs=epochs, verbose=0))
    if step.wanted("own test_step in evaluate"):
        with step("own test_step in evaluate"):
            model = _dense_regression(EvaluateWithOwnStep)
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
            model = sma(model)
            model.fit(x, y, epochs=1, verbose=0)
            step.accuracy["evaluate"] = model.evaluate(x, y, verbose=0, return_dict=True)
    with step(GAN_STEP):
        discriminator = keras.Sequential([
            keras.Input(shape=(28, 28, 1)), layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2), layers.GlobalMaxPooling2D(), layers.Dense(1)], name="discriminator")
        generator = keras.Sequential([
            keras.Input(shape=(8,)), layers.Dense(7 * 7 * 8), layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((7, 7, 8)), layers.Conv2DTranspose(8, (4, 4), strides=(4, 4), padding="same"),
            layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid")], name="generator")
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=8)
        gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
        gan = sma(gan)
        (digits, _), _ = load_embedded_mnist()
        gan.fit(tf.data.Dataset.from_tensor_slices(digits[:256]).batch(64), epochs=1, verbose=0)


def _lower_level(sma, step, x, y):
    with step("lower-level: own loss and trackers, no compiled loss"):
        model = _dense_regression(FitLowerLevel)
        model.compile(optimizer="adam")
        model = sma(model)
        _final_loss(step, "lower-level", model.fit(x, y, epochs=5, verbose=0))


# The step use_sma refuses by design, and the words its refusal must hold (crossbow_tf/training_hooks.py).
GAN_STEP = "GAN: two optimizers of its own"
EXPECTED_REFUSALS = {GAN_STEP: "optimizer other than model.optimizer"}


class Distiller(keras.Model):
    """keras-io's knowledge distillation in its Keras 3 form: the objective in compute_loss."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            keras.ops.softmax(teacher_pred / self.temperature, axis=1),
            keras.ops.softmax(y_pred / self.temperature, axis=1)) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _conv_classifier(width, name):
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(width, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(2 * width, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10)], name=name)


def knowledge_distillation(sma, step):
    (x_train, y_train), (x_test, y_test) = load_embedded_mnist()
    if step.short:
        x_train, y_train = x_train[:HOOKS_SHORT_EXAMPLES], y_train[:HOOKS_SHORT_EXAMPLES]
    teacher, student = _conv_classifier(64, "teacher"), _conv_classifier(16, "student")
    with step("train the teacher (plain Keras in both runs)"):
        teacher.compile(optimizer=keras.optimizers.Adam(),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        metrics=[keras.metrics.SparseCategoricalAccuracy()])
        teacher.fit(x_train, y_train, epochs=1 if step.short else 2, verbose=0)
    with step("distill (compute_loss of its own)"):
        distiller = Distiller(student=student, teacher=teacher)
        distiller.compile(optimizer=keras.optimizers.Adam(), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                          student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
        distiller = sma(distiller)
        distiller.fit(x_train, y_train, epochs=1 if step.short else 3, verbose=0)
    with step("evaluate the student"):
        step.accuracy["test"] = distiller.evaluate(x_test, y_test, verbose=0)[1]


class Sampling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=keras.ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras-io's variational autoencoder: its own train_step, its own trackers, no call."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = keras.ops.mean(keras.ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
            kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def variational_autoencoder(sma, step):
    latent_dim = 2
    with step("build"):
        encoder_inputs = keras.Input(shape=(28, 28, 1))
        x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
        x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Dense(16, activation="relu")(layers.Flatten()(x))
        z_mean = layers.Dense(latent_dim, name="z_mean")(x)
        z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
        encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")
        latent_inputs = keras.Input(shape=(latent_dim,))
        x = layers.Reshape((7, 7, 64))(layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs))
        x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
        decoder = keras.Model(latent_inputs, layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x),
                              name="decoder")
    (x_train, _), (x_test, _) = load_embedded_mnist()
    digits = np.concatenate([x_train, x_test])
    if step.short:
        digits = digits[:HOOKS_SHORT_EXAMPLES]
    with step("compile and fit (train_step of its own)"):
        vae = VAE(encoder, decoder)
        vae.compile(optimizer=keras.optimizers.Adam())
        vae = sma(vae)
        history = vae.fit(digits, epochs=1 if step.short else 5, batch_size=128, verbose=0)
        _final_loss(step, "loss", history)
        for key in ("reconstruction_loss", "kl_loss"):
            _final_loss(step, key, history, key, checked=False)


SCRIPTS = {
    "mnist_convnet": lambda sma, step, workdir: mnist_convnet(sma, step),
    "antirectifier": lambda sma, step, workdir: antirectifier(sma, step),
    "writing_your_own_callbacks": lambda sma, step, workdir: writing_your_own_callbacks(sma, step),
    "training_with_built_in_methods": training_with_built_in_methods,
    "text_classification_with_transformer": lambda sma, step, workdir: text_classification_with_transformer(sma, step),
    "bidirectional_lstm_imdb": lambda sma, step, workdir: bidirectional_lstm_imdb(sma, step),
    "custom_train_step": lambda sma, step, workdir: custom_train_step(sma, step),
    "knowledge_distillation": lambda sma, step, workdir: knowledge_distillation(sma, step),
    "variational_autoencoder": lambda sma, step, workdir: variational_autoencoder(sma, step),
}
# The scripts the default run takes: the two NLP scripts (issue 26) run when named, their
# replicated form being minutes long.
DEFAULT_SCRIPTS = ("mnist_convnet", "antirectifier", "writing_your_own_callbacks", "training_with_built_in_methods")


class _NoticeRecorder(logging.Handler):
    def __init__(self, into):
        super().__init__()
        self.into = into

    def emit(self, record):
        message = record.getMessage()
        if "learners run replicated" in message:
            self.into.append(message)


@contextlib.contextmanager
def _replicated_notices(into):
    """Records into INTO every notice the engine logs that a model's learners run replicated."""
    recorder = _NoticeRecorder(into)
    logger = logging.getLogger("crossbow_tf")
    logger.addHandler(recorder)
    try:
        yield
    finally:
        logger.removeHandler(recorder)


def run(names, short=False, sgd=False, learning_rate_scale=1.0, seed=0, only=None, outer_rate=None,
        noise_matching="auto"):
    """{script: {"plain": Steps, "sma": Steps}}: each script once in plain Keras, once with SMA.

    SGD: every optimizer line swapped for SGD_OPTIMIZERS' (else the scripts' own). LEARNING_RATE_SCALE:
    use_sma's (1, the default, is the two lines as written); NOISE_MATCHING: use_sma's ("auto", the default)."""
    OPTIMIZERS.clear()
    OPTIMIZERS.update(SGD_OPTIMIZERS if sgd else OWN_OPTIMIZERS)
    options = {} if learning_rate_scale == 1.0 else {"learning_rate_scale": learning_rate_scale}
    if noise_matching != "auto":
        options["noise_matching"] = noise_matching
    if outer_rate is not None:
        # Local SGD averaging every step, z moving OUTER_RATE times the learners' mean step (docs/keras.md).
        options["algorithm"] = crossbow_tf.algorithms.LocalSGD(period=1, outer_learning_rate=outer_rate)
    results = {}
    for name in names:
        results[name] = {}
        for mode, sma in (("plain", lambda model: model),
                          ("sma", lambda model: crossbow_tf.use_sma(model, strategy, **options))):   # extra line 2
            keras.utils.set_random_seed(seed)
            steps = Steps(short, only)
            with tempfile.TemporaryDirectory() as workdir, _replicated_notices(steps.replicated_notices):
                SCRIPTS[name](sma, steps, workdir)
            results[name][mode] = steps
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scripts", nargs="+", choices=list(SCRIPTS), default=list(DEFAULT_SCRIPTS))
    p.add_argument("--short", action="store_true",
                   help="CI's form: leave out steps that repeat others, train the two classifiers 1 epoch on 2,048 digits")
    p.add_argument("--sgd", action="store_true",
                   help="swap every optimizer line for momentum SGD (this tool's form before use_sma took Adam/RMSprop)")
    p.add_argument("--learning-rate-scale", type=float, default=1.0,
                   help="use_sma(..., learning_rate_scale=S) in the SMA run (default 1: the two lines as written)")
    p.add_argument("--seed", type=int, default=0, help="keras.utils.set_random_seed before each run (default 0)")
    p.add_argument("--learners-per-device", type=int, default=2,
                   help="the strategy's learners per device (of 2 logical devices; default 2, so k = 4)")
    p.add_argument("--only", nargs="+", metavar="STEP",
                   help="run only these steps of the guides (e.g. \"end-to-end example\"); the classifiers always run")
    p.add_argument("--local-sgd-outer-rate", type=float, metavar="R",
                   help="use_sma(..., algorithm=LocalSGD(period=1, outer_learning_rate=R)) instead of SMA")
    p.add_argument("--noise-matching", choices=("auto", "on", "off"), default="auto",
                   help="use_sma(..., noise_matching=...) in the SMA run (default auto: the two lines as written)")
    p.add_argument("--require-within", type=float, metavar="POINTS",
                   help="exit 1 unless every step that runs in plain Keras runs with SMA and SMA's test accuracy "
                        "is at most POINTS below plain Keras's")
    p.add_argument("--loss-within", type=float, default=5.0, metavar="PERCENT",
                   help="with --require-within: where a script has no accuracy, SMA's final training losses at "
                        "most PERCENT above plain Keras's (default 5)")
    p.add_argument("--require-fused", action="store_true",
                   help="exit 1 if the SMA run of any script logged that its learners run replicated")
    p.add_argument("--nlp-reviews", type=_positive, metavar="N",
                   help=f"the NLP scripts' training reviews (half as many test reviews; default {NLP_FULL_REVIEWS})")
    p.add_argument("--nlp-maxlen", type=_positive, metavar="L",
                   help="the NLP scripts' maxlen, if below their own 200")
    args = p.parse_args(argv)
    NLP_SIZE.update(reviews=args.nlp_reviews, maxlen=args.nlp_maxlen)
    noise_matching = {"auto": "auto", "on": True, "off": False}[args.noise_matching]
    results = run(args.scripts, args.short, args.sgd, args.learning_rate_scale, args.seed, args.only,
                  args.local_sgd_outer_rate, noise_matching)
    print(f"optimizers: {'momentum SGD (--sgd)' if args.sgd else 'the scripts own'}; "
          f"use_sma learning_rate_scale {args.learning_rate_scale:g}, noise_matching {args.noise_matching}; "
          f"seed {args.seed}; k = {strategy.num_learners}"
          + (f"; LocalSGD(period=1, outer_learning_rate={args.local_sgd_outer_rate:g})"
             if args.local_sgd_outer_rate is not None else ""))
    print("| script | step | plain Keras | SMA | plain s | SMA s |")
    print("|---|---|---|---|---|---|")
    for name, modes in results.items():
        plain, sma = modes["plain"], modes["sma"]
        for step_name, outcome in plain.outcome.items():
            ours = sma.outcome.get(step_name, "not run")
            print(f"| {name} | {step_name} | {_short(outcome)} | {_short(ours)} | "
                  f"{plain.seconds[step_name]:.1f} | {sma.seconds.get(step_name, float('nan')):.1f} |")
    for name, modes in results.items():
        if "test" in modes["plain"].accuracy:
            print(f"{name}: test accuracy plain Keras {modes['plain'].accuracy['test']:.4f}, "
                  f"SMA {modes['sma'].accuracy['test']:.4f}")
        for kind in ("loss", "terms"):
            for key, plain_loss in modes["plain"].accuracy.get(kind, {}).items():
                print(f"{name}: final training {key} plain Keras {plain_loss:.4f}, "
                      f"SMA {modes['sma'].accuracy.get(kind, {}).get(key, float('nan')):.4f}")
    for name, modes in results.items():
        notices = modes["sma"].replicated_notices
        print(f"{name}: SMA learners {'ran replicated: ' + notices[0] if notices else 'ran fused (no replicated notice)'}")
    print(json.dumps({name: {mode: {"outcome": s.outcome, "seconds": s.seconds, "results": s.accuracy,
                                    "replicated_notices": s.replicated_notices}
                             for mode, s in modes.items()} for name, modes in results.items()}))
    problems = []
    if args.require_fused:
        problems += [f"{name}: SMA's learners ran replicated ({len(modes['sma'].replicated_notices)} notice(s)): "
                     f"{modes['sma'].replicated_notices[0]}"
                     for name, modes in results.items() if modes["sma"].replicated_notices]
    if args.require_within is None:
        for problem in problems:
            print(f"keras_io_examples: {problem}", file=sys.stderr)
        return 1 if problems else 0
    for name, modes in results.items():
        plain, sma = modes["plain"], modes["sma"]
        problems += [f"{name}: step {step!r} runs in plain Keras and fails with SMA"
                     for step, outcome in plain.outcome.items()
                     if outcome == "ok" and sma.outcome.get(step) != "ok" and step not in EXPECTED_REFUSALS]
        problems += [f"{name}: step {step!r} is not refused as use_sma refuses it ({words!r}): "
                     f"{sma.outcome.get(step, 'not run')[:200]}"
                     for step, words in EXPECTED_REFUSALS.items() if step in plain.outcome
                     and words not in sma.outcome.get(step, "")]
        problems += _loss_problems(name, plain, sma, args.loss_within)
        if "test" in plain.accuracy and "test" in sma.accuracy:
            gap = 100 * (plain.accuracy["test"] - sma.accuracy["test"])
            if gap > args.require_within:
                problems.append(f"{name}: SMA's test accuracy {sma.accuracy['test']:.4f} is {gap:.1f} points below "
                                f"plain Keras's {plain.accuracy['test']:.4f} (allowed {args.require_within:g})")
    for problem in problems:
        print(f"keras_io_examples: {problem}", file=sys.stderr)
    if args.require_fused and not problems:
        print("keras_io_examples: every SMA run's learners ran fused")
    if not problems:
        print(f"keras_io_examples: every step that runs in plain Keras runs with SMA, and SMA is within "
              f"{args.require_within:g} points of plain Keras on every classifier")
    return 1 if problems else 0


def _loss_problems(name, plain, sma, percent):
    """Where a script reports final training losses and no accuracy: SMA's at most PERCENT above plain's."""
    if "test" in plain.accuracy:
        return []
    problems = []
    for key, plain_loss in plain.accuracy.get("loss", {}).items():
        ours = sma.accuracy.get("loss", {}).get(key)
        if ours is None or not ours <= plain_loss + abs(plain_loss) * percent / 100:
            problems.append(f"{name}: SMA's final training {key} {ours} is more than {percent:g}% above plain "
                            f"Keras's {plain_loss:.4f}")
    return problems


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _short(outcome):
    return outcome if outcome == "ok" else "fails: " + outcome.splitlines()[0][:60].replace("|", "/")


if __name__ == "__main__":
    sys.exit(main())
