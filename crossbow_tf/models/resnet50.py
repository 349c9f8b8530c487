"""ResNet-50 v1 for ImageNet (He et al., 2016), as Crossbow's ResNetv1 trained it."""
import keras
from keras import layers

BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9
STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))   # (bottleneck width, blocks); output is 4x width


def _conv(filters, kernel, stride, name):
    return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                         kernel_initializer="he_normal", name=name)


def _bn(name):
    return layers.BatchNormalization(epsilon=BN_EPSILON, momentum=BN_MOMENTUM, name=name)


def _bottleneck(x, width, stride, name):
    out = 4 * width
    shortcut = x
    if stride != 1 or x.shape[-1] != out:
        shortcut = _bn(f"{name}_proj_bn")(_conv(out, 1, stride, f"{name}_proj")(x))
    # v1 (as in the paper and Crossbow's ResNetv1): the stride sits on the 3x3 convolution
    # ("v1.5"); the original Caffe model strided the first 1x1. Parameter counts are equal.
    y = layers.ReLU(name=f"{name}_relu1")(_bn(f"{name}_bn1")(_conv(width, 1, 1, f"{name}_conv1")(x)))
    y = layers.ReLU(name=f"{name}_relu2")(_bn(f"{name}_bn2")(_conv(width, 3, stride, f"{name}_conv2")(y)))
    y = _bn(f"{name}_bn3")(_conv(out, 1, 1, f"{name}_conv3")(y))
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    return layers.ReLU(name=f"{name}_out")(y)


def resnet50(input_shape=(224, 224, 3), num_classes=1000, name="resnet50", stages=STAGES):
    """7x7/2 conv 64, BN, ReLU, 3x3/2 max-pool; bottleneck stages 3-4-6-3 (64/128/256/512 wide,
    x4 expansion, stride 2 at the first block of stages 2-4); global average pooling;
    Dense NUM_CLASSES (logits). STAGES: (bottleneck width, blocks) per stage (the tests' shallower
    copies keep every block kind with fewer repeats)."""
    inputs = keras.Input(input_shape)
    x = _conv(64, 7, 2, "stem_conv")(inputs)
    x = layers.ReLU(name="stem_relu")(_bn("stem_bn")(x))
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    for stage, (width, blocks) in enumerate(stages, start=1):
        for block in range(1, blocks + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            x = _bottleneck(x, width, stride, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, kernel_initializer="he_normal", name="logits")(x)
    return keras.Model(inputs, outputs, name=name)
