"""A model's own ``train_step``, run once per learner as the engine's learner computation.

For learner i the model's variables take that learner's weights and states, the model's own
``train_step`` runs on the learner's slice of the batch, and what it hands to ``model.optimizer``
(``apply`` or ``apply_gradients``) is taken as that learner's gradient instead of being applied: the
engine then takes the learner's step with it and SMA's correction and central update follow, as for
fit's own step. The states the step leaves in the model's variables are the learner's new states; the
metric trackers it updates are the model's own, updated by every learner's slice; the logs it returns
(the last learner's, after every learner has updated the trackers) are fit's logs.

Keras's stateless scope would substitute values without the copies, but a TensorFlow train_step
takes its gradients with a GradientTape on the variables themselves, which a substituted value does
not reach; so the learner's values are assigned in and read out, in program order inside the step's
graph (TensorFlow orders the reads and writes of one variable as the program does).
"""
import contextlib

import keras
import tensorflow as tf
from keras import tree


class ForeignOptimizer(ValueError):
    """The model's train_step drives an optimizer other than model.optimizer."""


@contextlib.contextmanager
def captured_gradients(model):
    """Inside, what model.optimizer is asked to apply is recorded ({id(variable): gradient}), not applied;
    any other Keras optimizer's apply raises ForeignOptimizer."""
    optimizer = model.optimizer
    captured = {}

    def capture(grads, trainable_variables=None):
        variables = trainable_variables if trainable_variables is not None else optimizer._trainable_variables
        for grad, variable in zip(grads, variables):
            if grad is not None:
                captured[id(variable)] = grad

    base_apply = keras.optimizers.Optimizer.apply

    def foreign_apply(self, grads, trainable_variables=None):
        if self is optimizer:
            return capture(grads, trainable_variables)
        raise ForeignOptimizer(
            f"{type(model).__name__}'s train_step applies gradients with an optimizer other than model.optimizer "
            f"({type(self).__name__} {self.name!r}): use_sma runs one set of learners, on model.optimizer; train "
            "a model with several optimizers (a GAN's) without use_sma")

    optimizer.apply = capture
    keras.optimizers.Optimizer.apply = foreign_apply
    try:
        yield captured
    finally:
        keras.optimizers.Optimizer.apply = base_apply
        del optimizer.apply


def flat_logs(logs):
    """LOGS with nested dicts merged into the top level, as Keras flattens fit's logs (a step that
    returns {m.name: m.result() for m in self.metrics} nests the compiled metrics' dict)."""
    flat = {}
    for name, value in (logs or {}).items():
        if isinstance(value, dict):
            flat.update(flat_logs(value))
        else:
            flat[name] = value
    return flat


class UserTrainStep:
    """The engine's learner computation for a model whose class overrides train_step (see module doc)."""

    fused = False

    def __init__(self, model, compiled_loss, input_packer=None, targets_given=True, own_loss_per_learner=False,
                 per_example_loss=None):
        self.model = model
        self.loss = compiled_loss            # unpacks the engine's targets: (y, sample_weight, real)
        self.input_packer = input_packer
        self.targets_given = targets_given
        # crossbow_tf.run's engine wants each learner's own loss, where fit wants its trackers' running
        # means over the epoch: with this, the trackers start afresh for every learner.
        self.own_loss_per_learner = own_loss_per_learner
        self.logs = None                     # {name: tf.Variable}: the last step's logs, made at the first trace
        self.per_example_loss = per_example_loss   # the evaluator's, in crossbow_tf.run

    def _data(self, x, y_in, mask):
        if self.input_packer is not None:
            x = self.input_packer.unpack(x)
        y, sample_weight, _ = self.loss.unpack_targets(y_in)
        real = mask > 0
        rows = tf.logical_or(real, tf.logical_not(tf.reduce_any(real)))
        data = keras.utils.pack_x_y_sample_weight(x, y if self.targets_given else None, sample_weight)
        return tree.map_structure(lambda t: tf.boolean_mask(t, rows), data), tf.reduce_any(real)

    def _run_learner(self, weights, states, data, has_rows):
        model = self.model
        if self.own_loss_per_learner:
            for metric in model.metrics:
                metric.reset_state()
        # The trackers the step finds (the first step may build more; those start at their initial values).
        trackers = [(v, tf.identity(v.value)) for v in model.metrics_variables]
        for variable, value in zip(model.trainable_variables, weights):
            variable.assign(value)
        for variable, value in zip(model.non_trainable_variables, states):
            variable.assign(value)
        with captured_gradients(model) as captured:
            logs = flat_logs(type(model).train_step(model, data))
        grads = [captured.get(id(v), tf.zeros_like(v)) for v in model.trainable_variables]
        new_states = [tf.where(has_rows, v.value, old) for v, old in zip(model.non_trainable_variables, states)]
        for variable, before in trackers:
            variable.assign(tf.where(has_rows, variable.value, before))
        grads = [tf.where(has_rows, tf.cast(g, w.dtype), tf.zeros_like(w)) for g, w in zip(grads, weights)]
        return logs, grads, new_states

    def _keep_logs(self, logs, has_rows):
        """Keeps LOGS of a learner with real rows (HAS_ROWS): the step's logs are the last such learner's."""
        if self.logs is None:
            with tf.init_scope():
                self.logs = {name: tf.Variable(tf.zeros(tf.convert_to_tensor(value).shape,
                                                        tf.convert_to_tensor(value).dtype), trainable=False,
                                               name=f"crossbow_log_{i}")
                             for i, (name, value) in enumerate(logs.items())}
        for name, value in logs.items():
            self.logs[name].assign(tf.where(has_rows, tf.cast(value, self.logs[name].dtype), self.logs[name]))

    def read_logs(self):
        """The logs the model's train_step returned at the last step, for fit."""
        return {name: variable.read_value() for name, variable in (self.logs or {}).items()}

    def __call__(self, weights, states, x, y, mask, scale=None):
        if scale is not None:
            raise ValueError(f"{type(self.model).__name__} has a train_step of its own: use_sma does not scale its "
                             "loss (mixed_float16); train in float32 or mixed_bfloat16")
        m = x.shape[0] if not tree.is_nested(x) else tree.flatten(x)[0].shape[0]
        losses, grads, new_states = [], [], []
        for i in range(m):
            data, has_rows = self._data(tree.map_structure(lambda t: t[i], x), y[i], mask[i])
            logs, grads_i, states_i = self._run_learner([w[i] for w in weights], [s[i] for s in states], data, has_rows)
            self._keep_logs(logs, has_rows)
            loss = tf.cast(tf.reshape(logs.get("loss", 0.0), []), tf.float32)
            losses.append(tf.where(has_rows, loss, 0.0))
            grads.append(grads_i)
            new_states.append(states_i)
        stack = lambda per_learner: [tf.stack(list(t)) for t in zip(*per_learner)]  # noqa: E731
        return tf.stack(losses), stack(grads), stack(new_states), tf.zeros(mask.shape, tf.float32)
