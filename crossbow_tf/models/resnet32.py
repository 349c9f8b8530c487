"""ResNet-32 for CIFAR-10 (He et al., 2016, section 4.2), as Crossbow trained it."""
import keras
from keras import layers

# Crossbow's ResNetv1ForCifar uses these BatchNorm settings (epsilon 1e-5, moving-average fraction
# 0.9); Keras's defaults (1e-3, 0.99) would change the model's behaviour at small batch sizes.
BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9


def _conv(filters, kernel, stride, name):
    # No bias: the BatchNorm that follows every convolution has its own shift.
    return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                         kernel_initializer="he_normal", name=name)


def _bn(name):
    return layers.BatchNormalization(epsilon=BN_EPSILON, momentum=BN_MOMENTUM, name=name)


def _basic_block(x, filters, stride, name):
    shortcut = x
    y = _conv(filters, 3, stride, f"{name}_conv1")(x)
    y = _bn(f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = _conv(filters, 3, 1, f"{name}_conv2")(y)
    y = _bn(f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _conv(filters, 1, stride, f"{name}_proj")(x)
        shortcut = _bn(f"{name}_proj_bn")(shortcut)
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    return layers.ReLU(name=f"{name}_out")(y)


def resnet32(input_shape=(32, 32, 3), num_classes=10, blocks_per_stage=5, name="resnet32"):
    """3x3 conv 16, BN, ReLU; 3 stages of BLOCKS_PER_STAGE basic blocks (16, 32, 64 filters,
    stride 2 at the first block of stages 2 and 3, 1x1-conv+BN projection where the shape changes);
    global average pooling; Dense NUM_CLASSES (logits). Depth is 6 * BLOCKS_PER_STAGE + 2."""
    inputs = keras.Input(input_shape)
    x = _conv(16, 3, 1, "stem_conv")(inputs)
    x = _bn("stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    for stage, filters in enumerate((16, 32, 64), start=1):
        for block in range(1, blocks_per_stage + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            x = _basic_block(x, filters, stride, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, kernel_initializer="he_normal", name="logits")(x)
    return keras.Model(inputs, outputs, name=name)
