"""The paper's models, by name."""
from crossbow_tf.errors import ConfigError
from crossbow_tf.models.lenet import lenet, lenet_bn
from crossbow_tf.models.resnet32 import resnet32
from crossbow_tf.models.resnet50 import resnet50
from crossbow_tf.models.vgg16 import vgg16

MODELS = {"lenet": lenet, "lenet_bn": lenet_bn, "resnet32": resnet32, "vgg16": vgg16, "resnet50": resnet50}


def build_model(name, input_shape, num_classes):
    """Builds model NAME (a key of MODELS) returning logits."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}") from None
    return factory(input_shape=input_shape, num_classes=num_classes)
