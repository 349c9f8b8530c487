"""The sequence and attention models of the throughput bench (issue 26), shaped as keras-io builds them,
and their data: a transformer classifier and a BiLSTM on offline IMDB-format tokens
(crossbow_tf/data/synthetic_imdb.py), and a ViT-style model on the embedded digits.

- transformer: keras-io's text_classification_with_transformer (embed 32, 2 heads, feed-forward 32,
  dropout 0.1), written functionally so that its layers are the model's own: Embedding, a custom
  position-embedding layer (with its own weights, as most keras-io models have one), MultiHeadAttention,
  LayerNormalization and Dense;
- bilstm: keras-io's bidirectional_lstm_imdb (Embedding 128, Bidirectional(LSTM(64)) twice);
- vit: 4x4 patches by a strided Conv2D, a reshape to a sequence, the custom position embedding, one
  transformer block (4 heads), LayerNormalization and a pooled Dense head.
All return logits.
"""
import keras
from keras import layers



@keras.saving.register_keras_serializable("crossbow_bench")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position (keras-io's TokenAndPositionEmbedding's second half)."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim
        self.positions = layers.Embedding(length, dim)

    def build(self, input_shape):
        self.positions.build((self.length,))

    def call(self, x):
        return x + self.positions(keras.ops.arange(keras.ops.shape(x)[1]))

    def get_config(self):
        return dict(super().get_config(), length=self.length, dim=self.dim)


def _transformer_block(x, dim, heads, ff_dim, rate, key_dim):
    attended = layers.MultiHeadAttention(num_heads=heads, key_dim=key_dim)(x, x)
    x = layers.LayerNormalization(epsilon=1e-6)(layers.Add()([x, layers.Dropout(rate)(attended)]))
    fed = layers.Dense(dim)(layers.Dense(ff_dim, activation="relu")(x))
    return layers.LayerNormalization(epsilon=1e-6)(layers.Add()([x, layers.Dropout(rate)(fed)]))


def transformer(length, vocabulary, num_classes):
    dim = 32
    inputs = keras.Input((length,), dtype="int32")
    x = PositionEmbedding(length, dim)(layers.Embedding(vocabulary, dim)(inputs))
    x = _transformer_block(x, dim, heads=2, ff_dim=32, rate=0.1, key_dim=dim)
    x = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(x))
    x = layers.Dropout(0.1)(layers.Dense(20, activation="relu")(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="transformer")


def bilstm(length, vocabulary, num_classes):
    inputs = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, 128)(inputs)
    x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(64))(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="bilstm")


def vit(input_shape, num_classes, patch=4, dim=64):
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(dim, patch, strides=patch)(inputs)
    count = (input_shape[0] // patch) * (input_shape[1] // patch)
    x = PositionEmbedding(count, dim)(layers.Reshape((count, dim))(x))
    x = _transformer_block(x, dim, heads=4, ff_dim=2 * dim, rate=0.1, key_dim=dim // 4)
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-6)(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="vit")


def load(name, examples, length=64, vocabulary=20000):
    """(data source, model factory) of bench model NAME over EXAMPLES training examples."""
    import numpy as np

    from crossbow_tf.data import from_arrays, load_embedded_mnist
    if name == "vit":
        (x, y), _ = load_embedded_mnist()
        x, y = x[:examples], y[:examples]
        data = from_arrays("digits", (x, y), (x[:1], y[:1]), num_classes=10)
        return data, lambda: vit(data.input_shape, data.num_classes)
    from crossbow_tf.data.synthetic_imdb import load_synthetic_imdb
    (x, y), _ = load_synthetic_imdb(num_words=vocabulary, train_size=examples, test_size=1)
    x = keras.utils.pad_sequences(x, maxlen=length).astype(np.int32)
    y = y.astype(np.int32)
    data = from_arrays("synthetic_imdb", (x, y), (x[:1], y[:1]), num_classes=2)
    build = transformer if name == "transformer" else bilstm
    return data, lambda: build(length, vocabulary, data.num_classes)
