"""The kill-and-resume test's model with Adam (test_learner_optimizers): the BatchNorm + Dropout model
of the checkpoint tests (bn_dropout_run.bn_dropout) without its convolution. What that test checks
(Adam's stacked moments, BatchNorm's statistics, Dropout's seeds and noise matching's running
means in the checkpoint, restored bit for bit) needs a BatchNorm and a Dropout layer, not a
convolution, whose tracing and XLA compile each of the test's three processes paid."""


def bn_dropout_dense(input_shape, num_classes):
    import keras
    layers = keras.layers
    return keras.Sequential([keras.Input(input_shape), layers.Flatten(), layers.Dense(16, use_bias=False),
                             layers.BatchNormalization(), layers.ReLU(), layers.Dropout(0.3),
                             layers.Dense(num_classes)], name="bn_dropout_dense")
