"""VGG-16 for CIFAR-100 in the cifar-vgg style (Liu & Deng, 2015; geifmany/cifar-vgg), as Crossbow
trained it (its VGG.java)."""
import keras
from keras import layers

# (filters, convolutions) per stage; a 2x2 max-pool closes every stage.
STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


def vgg16(input_shape=(32, 32, 3), num_classes=100, name="vgg16", stages=STAGES):
    """13 3x3 convs, each followed by ReLU, BatchNorm and (except before a pool) dropout: 0.3 after
    the net's first conv, 0.4 after the others; head: dropout 0.5, Dense 512, ReLU, BN,
    dropout 0.5, Dense NUM_CLASSES (logits).

    Keras's default initialisers (Glorot uniform, zero bias) and BatchNorm settings (epsilon 1e-3,
    momentum 0.99) are what both cifar-vgg and Crossbow's VGG.java use. STAGES: (filters, convs) per
    stage (the tests' shallower copies keep every layer kind with fewer repeats).
    """
    inputs = keras.Input(input_shape)
    x = inputs
    first = True
    for stage, (filters, convs) in enumerate(stages, start=1):
        for i in range(1, convs + 1):
            prefix = f"block{stage}_conv{i}"
            x = layers.Conv2D(filters, 3, padding="same", name=prefix)(x)
            x = layers.ReLU(name=f"{prefix}_relu")(x)
            x = layers.BatchNormalization(name=f"{prefix}_bn")(x)
            if i < convs:
                x = layers.Dropout(0.3 if first else 0.4, name=f"{prefix}_dropout")(x)
            first = False
        x = layers.MaxPooling2D(2, name=f"block{stage}_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dropout(0.5, name="head_dropout1")(x)
    x = layers.Dense(512, name="fc")(x)
    x = layers.ReLU(name="fc_relu")(x)
    x = layers.BatchNormalization(name="fc_bn")(x)
    x = layers.Dropout(0.5, name="head_dropout2")(x)
    outputs = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name=name)
