"""The compiled Keras loss as a per-example function, and packing of nested inputs and outputs.

The engine needs a loss (y_true, y_pred) -> one value per example, because it masks padding rows
and weights learners by their real examples itself. Keras's ``CompileLoss`` knows the model's loss
structure (one loss per output, loss weights, output names); this module reuses its resolution
(``CompileLoss.build``) and evaluates every resolved loss unreduced.

The engine also slices x, y and predictions by reshaping single tensors. Models with several inputs
or outputs are therefore run through ``PackedModel``, which takes all inputs packed into one tensor
per example and returns all outputs packed into one tensor; its variables are the user's model's
own variables, in the same order, so the engine's learners and z are unaffected by the packing.
"""
import math

import keras
import tensorflow as tf
from keras import tree
# Keras's own rule for matching sample weights to losses of another rank.
from keras.src.losses.loss import squeeze_or_expand_to_same_rank

# Reductions under which Keras's reduced loss equals the mean of the per-example losses that the
# engine averages; any other reduction would make SMA optimise a different objective.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def check_compiled_loss(model):
    """Raises ValueError for a loss that Keras would reject or that the engine cannot average."""
    loss = getattr(model, "loss", None)
    if loss is None:
        return   # the model's loss comes from add_loss alone; CompiledLoss then gives 0 per example
    if all(l is None for l in tree.flatten(loss)):
        raise ValueError(f"model {model.name!r} was compiled with no loss for any output: pass loss=... to "
                         "model.compile() before enabling Crossbow training")
    for leaf in tree.flatten(loss):
        if leaf is None:
            continue
        try:
            resolved = keras.losses.get(leaf)
        except (ValueError, TypeError) as error:
            raise ValueError(f"Keras rejects the compiled loss {leaf!r}: {error}") from None
        if resolved is None or not callable(resolved):
            raise ValueError(f"Keras rejects the compiled loss {leaf!r}: it is not a loss")
        reduction = getattr(resolved, "reduction", "sum_over_batch_size")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"loss {getattr(resolved, 'name', leaf)!r} has reduction={reduction!r}; Crossbow "
                f"training averages per-example losses, so use one of {', '.join(_MEAN_REDUCTIONS)}")


def _reconcile_targets(compile_loss, y_true, y_pred):
    """Brings y_true to the structure of y_pred, as ``CompileLoss.call`` does before building."""
    if not tree.is_nested(y_true) and not tree.is_nested(y_pred):
        return y_true
    try:
        tree.assert_same_structure(y_pred, y_true)
        return y_true
    except ValueError:
        pass
    if not tree.is_nested(y_true) and hasattr(y_pred, "__len__") and len(y_pred) == 1:
        y_true = [y_true]
    elif isinstance(y_pred, (list, tuple)) and isinstance(y_true, dict):
        names = compile_loss.output_names or []
        if set(names) == set(y_true.keys()):
            y_true = [y_true[name] for name in names]
    try:
        return tree.pack_sequence_as(y_pred, tree.flatten(y_true))
    except (ValueError, TypeError):
        raise ValueError("the targets y do not match the model's outputs: y has structure "
                         f"{tree.map_structure(lambda _: '*', y_true)}, the outputs have "
                         f"{tree.map_structure(lambda _: '*', y_pred)}") from None


def _resolve(path, structure):
    for key in path:
        structure = structure[key]
    return structure


def _per_example_mean(values, rows):
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        # A loss that reduces the batch itself (keras-io's custom_mean_squared_error): the engine
        # calls it on one learner's slice, so this is that learner's loss, given to each of its ROWS.
        # Padding rows of a last partial batch are then not kept out of it.
        return tf.fill([rows], values)
    if values.shape.rank == 1:
        return values
    return tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


class CompiledLoss:
    """The model's compiled loss, evaluated per example, with Keras's sample-weight semantics.

    ``build`` must run once (at trace time of the first training step) with the targets and a
    symbolic description of the outputs. A model compiled without a loss (its loss comes from
    ``add_loss`` alone) gives 0 per example; the engine adds the model's own losses.

    The engine hands the loss one learner's targets and predictions. When the step carries sample
    weights, ``target_packer`` packs (y, sample_weight, real) into the targets, where REAL marks the
    learner's real (not padding) examples, so that every learner's loss is Keras's weighted
    reduction over its own examples: sum(w*l) / examples, or sum(w*l) / sum(w) for
    reduction="mean_with_sample_weight". ``output_packer`` unpacks packed predictions.
    """

    def __init__(self, model):
        self.model = model
        self.compile_loss = model._compile_loss
        self.target_packer = None
        self.weighted = False
        self.output_packer = None

    @property
    def has_loss(self):
        return self.compile_loss is not None

    def build(self, y_true, y_pred_spec):
        if not self.has_loss:
            return
        y_true = _reconcile_targets(self.compile_loss, y_true, y_pred_spec)
        if not self.compile_loss.built:
            try:
                self.compile_loss.build(y_true, y_pred_spec)
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(f"Keras rejects the compiled loss for this model: {error}") from None

    @property
    def output_metrics(self):
        """Keras's per-output loss trackers (present when the model has several losses)."""
        return list(self.compile_loss.metrics) if self.has_loss else []

    def per_output(self, y_true, y_pred, sample_weight=None, real=None):
        """Per-example losses, one (n,) tensor per resolved loss, each weighted by SAMPLE_WEIGHT (a
        tensor for every output, or a structure like the outputs') as Keras's reduction weighs it;
        REAL (n,) marks the examples that count in a weighted mean."""
        cl = self.compile_loss
        y_true = _reconcile_targets(cl, y_true, y_pred)
        try:
            tree.assert_same_structure(cl._y_pred_build_structure, y_pred)
        except ValueError:
            y_pred = tree.pack_sequence_as(cl._y_pred_build_structure, tree.flatten(y_pred))
        try:
            tree.assert_same_structure(cl._y_true_build_structure, y_true)
        except ValueError:
            y_true = tree.pack_sequence_as(cl._y_true_build_structure, tree.flatten(y_true))
        out = []
        for path, loss_fn, _, _ in cl._flat_losses:
            y_t, y_p = _resolve(path, y_true), _resolve(path, y_pred)
            dtype = getattr(loss_fn, "dtype", None) or "float32"
            y_t = tree.map_structure(lambda t: tf.cast(t, dtype), y_t)
            y_p = tree.map_structure(lambda t: tf.cast(t, dtype), y_p)
            values = loss_fn.call(y_t, y_p) if hasattr(loss_fn, "call") else loss_fn(y_t, y_p)
            values = tf.convert_to_tensor(values)
            if sample_weight is not None:
                weight = _resolve(path, sample_weight) if tree.is_nested(sample_weight) else sample_weight
                values = _weighted(values, weight, real, getattr(loss_fn, "reduction", None))
            out.append(tf.cast(_per_example_mean(values, tf.shape(tree.flatten(y_p)[0])[0]), tf.float32))
        return out

    def unpack_targets(self, y_in):
        """(y, sample_weight, real) of the engine's targets."""
        targets = self.target_packer.unpack(y_in) if self.target_packer is not None else y_in
        return targets if self.weighted else (targets, None, None)

    def __call__(self, y_in, y_pred):
        """The weighted sum over outputs of the per-example losses: shape (n,)."""
        if self.output_packer is not None:
            y_pred = self.output_packer.unpack(y_pred)
        if not self.has_loss:
            first = tree.flatten(y_pred)[0]
            return tf.zeros([tf.shape(first)[0]], tf.float32)
        y_true, sample_weight, real = self.unpack_targets(y_in)
        total = None
        for value, (_, _, weight, _) in zip(self.per_output(y_true, y_pred, sample_weight, real),
                                            self.compile_loss._flat_losses):
            if weight is not None:
                value = value * weight
            total = value if total is None else total + value
        return total


class OverriddenLoss(CompiledLoss):
    """The model's own ``compute_loss`` (its class overrides it), run for each learner as Keras runs it
    after the forward pass: with that learner's inputs, targets, predictions and sample weights, its
    weights and states in place of the model's variables (Keras's ``stateless_compute_loss``), and the
    forward pass's ``add_loss`` terms as ``self.losses``. Padding rows of a last partial batch come with
    sample weight 0, times the user's sample weights where the step has them."""

    def __init__(self, model):
        super().__init__(model)
        self.input_packer = None
        self.targets_given = True    # False: fit gave no y, and the override gets y=None as in Keras

    def learner_loss(self, x, y_in, y_pred, mask, weights, states, forward_losses=()):
        model = self.model
        if self.input_packer is not None:
            x = self.input_packer.unpack(x)
        if self.output_packer is not None:
            y_pred = self.output_packer.unpack(y_pred)
        y, sample_weight, _ = self.unpack_targets(y_in)
        if sample_weight is None:
            sample_weight = mask
        else:
            sample_weight = tree.map_structure(
                lambda w: tf.cast(w, mask.dtype) * tf.reshape(mask, [-1] + [1] * (len(w.shape) - 1)), sample_weight)
        metrics = [v.value for v in model.metrics_variables]
        # As Keras's JAX trainer hands a stateless forward pass's losses to compute_loss.
        model._losses_override = list(forward_losses)
        try:
            loss, _ = model.stateless_compute_loss(weights, states, metrics, x=x, y=y if self.targets_given else None,
                                                   y_pred=y_pred, sample_weight=sample_weight, training=True)
        finally:
            model._losses_override = []
        return tf.cast(loss, tf.float32)


def _weighted(values, weight, real, reduction):
    """VALUES (n, ...) times the sample weights, scaled for REDUCTION so that their mean over the
    real examples is Keras's weighted reduction."""
    weight = tf.cast(weight, values.dtype)
    values, weight = squeeze_or_expand_to_same_rank(values, weight)
    weighted = values * weight
    if reduction == "mean_with_sample_weight":
        # Keras divides by the sum of the weights, not by the number of examples.
        real = tf.reshape(tf.cast(real, values.dtype), [-1] + [1] * (len(weighted.shape) - 1))
        real = tf.broadcast_to(real, tf.shape(weighted))
        weight = tf.broadcast_to(weight, tf.shape(weighted))
        weighted = weighted * tf.math.divide_no_nan(tf.reduce_sum(real), tf.reduce_sum(weight * real))
    return weighted


class Packer:
    """Packs a structure of per-example tensors (n, ...) into one (n, F) tensor, and back.

    Leaves of one dtype are concatenated as they are; mixed dtypes travel as bytes (bitcast), which is
    exact. ``differentiable`` packing (for outputs) casts every leaf to float32 instead, because
    bitcast has no gradient.
    """

    def __init__(self, structure, differentiable=False):
        leaves = tree.flatten(structure)
        self.structure = tree.map_structure(lambda _: None, structure)
        self.shapes = [tuple(leaf.shape[1:]) for leaf in leaves]
        self.dtypes = [tf.as_dtype(getattr(leaf.dtype, "name", leaf.dtype)) for leaf in leaves]
        for shape in self.shapes:
            if any(dim is None for dim in shape):
                raise ValueError(f"inputs and outputs need static shapes apart from the batch "
                                 f"dimension to be split among learners; got a leaf of shape {shape}")
        if any(dt == tf.string for dt in self.dtypes):
            raise ValueError("string inputs cannot be split among learners; map them to numbers first")
        self.differentiable = differentiable
        if differentiable:
            self.wire = tf.float32
        elif len(set(self.dtypes)) == 1 and self.dtypes[0] != tf.bool:
            self.wire = self.dtypes[0]
        else:
            self.wire = tf.uint8
        self.widths = [self._width(shape, dt) for shape, dt in zip(self.shapes, self.dtypes)]

    def _width(self, shape, dtype):
        n = math.prod(shape)
        if self.wire == tf.uint8 and dtype != tf.bool:
            return n * dtype.size
        return n

    def pack(self, structure):
        parts = []
        for leaf, dtype in zip(tree.flatten(structure), self.dtypes):
            leaf = tf.convert_to_tensor(leaf)
            rows = tf.shape(leaf)[0]
            if self.differentiable:
                leaf = tf.cast(leaf, tf.float32)
            elif self.wire == tf.uint8:
                leaf = tf.cast(leaf, tf.uint8) if dtype == tf.bool else tf.bitcast(leaf, tf.uint8)
            parts.append(tf.reshape(leaf, [rows, -1]))
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)

    def unpack(self, packed):
        leaves, offset = [], 0
        rows = tf.shape(packed)[0]
        for shape, dtype, width in zip(self.shapes, self.dtypes, self.widths):
            part = packed[:, offset:offset + width]
            offset += width
            if self.differentiable:
                leaf = tf.reshape(tf.cast(part, dtype), [rows, *shape])
            elif self.wire == tf.uint8:
                if dtype == tf.bool:
                    leaf = tf.reshape(tf.cast(part, tf.bool), [rows, *shape])
                elif dtype.size > 1:
                    leaf = tf.bitcast(tf.reshape(part, [rows, *shape, dtype.size]), dtype)
                else:
                    leaf = tf.bitcast(tf.reshape(part, [rows, *shape]), dtype)
            else:
                leaf = tf.reshape(part, [rows, *shape])
            leaves.append(leaf)
        return tree.pack_sequence_as(self.structure, leaves)


class PackedModel(keras.Model):
    """Runs MODEL on packed inputs and returns its outputs packed (see module docstring)."""

    def __init__(self, model, input_packer, output_packer):
        super().__init__(name=f"{model.name}_packed")
        self.inner = model
        self.input_packer = input_packer
        self.output_packer = output_packer
        self.built = True

    def call(self, packed, training=False):
        outputs = self.inner(self.input_packer.unpack(packed), training=training)
        return self.output_packer.pack(outputs)
