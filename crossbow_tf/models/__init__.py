"""The paper's models, by name."""
from crossbow_tf.errors import ConfigError
from crossbow_tf.models.lenet import lenet

MODELS = {"lenet": lenet}


def build_model(name, input_shape, num_classes):
    """Builds model NAME (a key of MODELS) returning logits."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}") from None
    return factory(input_shape=input_shape, num_classes=num_classes)
