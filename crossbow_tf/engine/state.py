"""The engine's variables, behind one object: per device the learners' stacks (weights, velocities,
non-trainable state, the Keras optimizer's slots), z, u and z's state, noise matching's statistics,
and for the whole engine the dynamic loss scale.

Checkpoints, the Keras path and the diagnostics read and write the engine's state only through
``EngineState`` (``groups``, ``variables``, ``restart_from_center``, ``assign_center``, the
``write_*_to`` copies into a Keras model); the compiled step reads its per-device lists.
"""
import dataclasses
from typing import NamedTuple

import numpy as np
import tensorflow as tf

# Seeds of per-learner random state (Dropout) differ by this odd stride so that no two learners
# draw the same masks.
SEED_STRIDE = 1_000_003

# The groups of per-device variables, in the order of ``EngineState.variables`` (the order the Keras
# path's state files were always written in) and under the names checkpoints have always used.
CENTER_GROUPS = ("center", "center_velocity", "center_states")
LEARNER_GROUPS = ("weights", "velocities", "states", "optimizer_states")
NOISE_GROUP = "noise_statistics"


@dataclasses.dataclass
class DeviceState:
    """One device's variables. WEIGHTS and VELOCITIES are empty for a rule that takes its gradient
    at z (S-SGD) and VELOCITIES also without learner momentum; the noise statistics without noise
    matching."""
    device: str
    center: list
    center_velocity: list
    center_states: list
    weights: list
    velocities: list
    states: list
    learner_square: list
    global_square: list

    @property
    def noise_statistics(self):
        return self.learner_square + self.global_square


def _learner_states(state, is_float, m, first_learner):
    """STATE stacked for M learners; integer state (random-generator state) gets each learner its
    own stream, learner j (global index from FIRST_LEARNER) offset by SEED_STRIDE * (j + 1)."""
    stack = np.stack([state] * m)
    if not is_float:
        for i in range(m):
            stack[i].flat[0] = stack[i].flat[0] + SEED_STRIDE * (first_learner + i + 1)
    return stack


def _device_state(device, weights, states, float_state, m, first_learner, keeps_learners, keeps_velocity,
                  noise_matching):
    with tf.device(device):
        return DeviceState(
            device=device,
            center=[tf.Variable(w, name="z") for w in weights],
            center_velocity=[tf.Variable(np.zeros_like(w), name="u") for w in weights],
            center_states=[tf.Variable(s, name="z_state") for s in states],
            weights=[tf.Variable(np.stack([w] * m), name="w") for w in weights] if keeps_learners else [],
            velocities=[tf.Variable(np.zeros((m,) + w.shape, w.dtype), name="v") for w in weights]
            if keeps_velocity else [],
            states=[tf.Variable(_learner_states(s, f, m, first_learner), name="state")
                    for s, f in zip(states, float_state)],
            learner_square=[tf.Variable(np.zeros(w.shape, np.float32), trainable=False, name="learner_square")
                            for w in weights] if noise_matching else [],
            global_square=[tf.Variable(np.zeros(w.shape, np.float32), trainable=False, name="global_square")
                           for w in weights] if noise_matching else [])


class EngineState:
    """Every variable of an engine: ``devices[d]`` (a DeviceState) per device, the learners' Keras
    optimizer clones (``attach_optimizers``) and the dynamic loss scale (``add_loss_scale``).

    WEIGHTS and STATES (NumPy arrays, the model's trainable and non-trainable values) start z and
    every learner; FLOAT_STATE says which states are float (averaged into z's) and which are seed
    state (each learner's own). KEEPS_LEARNERS: the rule keeps learner weights (not S-SGD);
    KEEPS_VELOCITY: and a momentum velocity per learner; NOISE_MATCHING: its statistics."""

    def __init__(self, devices, weights, states, float_state, learners_per_device, first_learner=0, *,
                 keeps_learners=True, keeps_velocity=True, noise_matching=False):
        self.float_state = list(float_state)
        self.learners_per_device = m = learners_per_device
        self.keeps_learners = keeps_learners
        self.devices = [_device_state(device, weights, states, self.float_state, m, first_learner + d * m,
                                      keeps_learners, keeps_velocity and keeps_learners, noise_matching)
                        for d, device in enumerate(devices)]
        self.noise_matching = noise_matching
        self.optimizers = None
        self.loss_scale = self.good_steps = None

    def attach_optimizers(self, optimizers):
        """OPTIMIZERS (a StackedOptimizers built on the learners' stacks, or on z for S-SGD)."""
        self.optimizers = optimizers

    def add_loss_scale(self, initial_scale):
        """The dynamic loss scale, one for every learner, and its good iterations since it last
        changed, on the first device."""
        with tf.device(self.devices[0].device):
            self.loss_scale = tf.Variable(float(initial_scale), dtype=tf.float32, trainable=False, name="loss_scale")
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps")

    # ------------------------------------------------------------------------------- the variables
    def per_device(self, name):
        """Group NAME (one of CENTER_GROUPS, LEARNER_GROUPS or NOISE_GROUP), a list over devices."""
        if name == "optimizer_states":
            return [self.optimizers.state(d) if self.optimizers is not None else []
                    for d in range(len(self.devices))]
        if name in ("weights", "velocities") and not self.keeps_learners:
            return []   # no learner stacks at all (as checkpoints of such rules have always been written)
        return [getattr(device, name) for device in self.devices]

    def learner_groups(self):
        """The learners' groups by name (each a list over devices); the optimizer's only with one."""
        names = LEARNER_GROUPS if self.optimizers is not None else LEARNER_GROUPS[:-1]
        return {name: self.per_device(name) for name in names}

    def center_groups(self):
        """z's groups by name (each a list over devices), with noise matching's statistics when on:
        the state that is the same on every device and worker."""
        names = CENTER_GROUPS + ((NOISE_GROUP,) if self.noise_matching else ())
        return {name: self.per_device(name) for name in names}

    def shared_variables(self, d):
        """Device D's variables that every device and worker holds alike (z, u, z's state, noise statistics)."""
        return [v for group in self.center_groups().values() for v in group[d]]

    def variables(self):
        """Every per-device variable, in one fixed order: z's groups, the learners', the noise statistics
        (the loss scale is ``scale_variables``)."""
        order = CENTER_GROUPS + LEARNER_GROUPS + (NOISE_GROUP,)
        return [v for name in order for per_device in self.per_device(name) for v in per_device]

    def scale_variables(self):
        """The loss scale and its good-step count (empty without loss scaling)."""
        return [] if self.loss_scale is None else [self.loss_scale, self.good_steps]

    # ------------------------------------------------------------------------------ the operations
    def restart_from_center(self):
        """Every learner's weights and float state set to z's (velocities and slots kept); inside a
        tf.function or eagerly."""
        m = self.learners_per_device
        for device in self.devices:
            with tf.device(device.device):
                for w, z in zip(device.weights, device.center):
                    w.assign(tf.broadcast_to(z, [m] + z.shape.as_list()))
                for s, zs, f in zip(device.states, device.center_states, self.float_state):
                    if f:
                        s.assign(tf.broadcast_to(zs, [m] + zs.shape.as_list()))

    def assign_center(self, weights, states):
        """A new start (eagerly): z and every learner from WEIGHTS and the float STATES (NumPy arrays
        in the model's order), u, the velocities, the optimizer's slots and the noise statistics back to
        their initial values. The learners' seed state is kept."""
        m = self.learners_per_device
        for device in self.devices:
            for i, w in enumerate(weights):
                device.center[i].assign(w)
                device.center_velocity[i].assign(np.zeros_like(w))
                if device.weights:
                    device.weights[i].assign(np.stack([w] * m))
                if device.velocities:
                    device.velocities[i].assign(np.zeros((m,) + w.shape, w.dtype))
            for i, (s, f) in enumerate(zip(states, self.float_state)):
                if f:
                    device.center_states[i].assign(s)
                    device.states[i].assign(np.stack([s] * m))
            for v in device.noise_statistics:
                v.assign(tf.zeros_like(v))
        if self.optimizers is not None:
            self.optimizers.restart()

    def center_arrays(self):
        """z's trainable weights as NumPy arrays, from the first device."""
        return [z.numpy() for z in self.devices[0].center]

    def center_state_arrays(self):
        """z's non-trainable state as NumPy arrays, from the first device."""
        return [s.numpy() for s in self.devices[0].center_states]

    def learner_arrays(self):
        """Every learner's trainable weights (list over learners of lists of arrays); z's for each
        learner of a rule that keeps no learner weights."""
        m = self.learners_per_device
        if not self.keeps_learners:
            return [self.center_arrays() for _ in range(m * len(self.devices))]
        out = []
        for device in self.devices:
            stacks = [w.numpy() for w in device.weights]
            out.extend([[s[i] for s in stacks] for i in range(m)])
        return out

    def center_matches(self, weights, states):
        """Whether WEIGHTS and the float STATES (NumPy arrays) are z's."""
        return all(np.array_equal(a, b) for a, b in zip(weights, self.center_arrays(), strict=True)) and all(
            np.array_equal(a, b) for a, b, f in zip(states, self.center_state_arrays(), self.float_state, strict=True)
            if f)

    def write_center_to(self, model):
        """Copies z (weights and averaged float state) into MODEL's variables."""
        device = self.devices[0]
        for var, z in zip(model.trainable_variables, device.center):
            var.assign(z)
        for var, z, f in zip(model.non_trainable_variables, device.center_states, self.float_state):
            if f:
                var.assign(z)

    def write_learner_to(self, model, j):
        """Copies learner J's weights and float state into MODEL's variables."""
        d, i = divmod(j, self.learners_per_device)
        device = self.devices[d]
        for var, w in zip(model.trainable_variables, device.weights):
            var.assign(w[i])
        for var, s, f in zip(model.non_trainable_variables, device.states, self.float_state):
            if f:
                var.assign(s[i])


class SyncPayload(NamedTuple):
    """What one device contributes to a synchronising iteration's all-reduce, one tensor per weight
    in each list: the learners' summed contributions (TOTALS), with noise matching their summed
    STEPS and their example-weighted GRADIENTS and SQUARES, and the float STATE_TOTALS (each
    learner's state minus z's, summed). Packed into one flat list (``pack``) for the reduction and
    unpacked from it (``unpack``) in this one place."""
    totals: list
    steps: list
    gradients: list
    squares: list
    state_totals: list

    def pack(self):
        return tf.nest.flatten(self)

    def unpack(self, flat):
        """FLAT (a reduced ``pack()`` of a payload of this one's layout) as a SyncPayload."""
        return tf.nest.pack_sequence_as(self, list(flat))


class WorkerPayload(NamedTuple):
    """What a worker contributes to the iteration's one cross-worker all-reduce: its devices' SUMS
    (a SyncPayload), its LOSS_SUM, its STOP_VOTE (a stop signal it received), NON_FINITE (a
    non-finite loss in a local step since the last synchronisation) and OVERFLOWS (with loss
    scaling, 1 when a gradient of its learners is not finite this iteration)."""
    sums: SyncPayload
    loss_sum: tf.Tensor
    stop_vote: tf.Tensor
    non_finite: tf.Tensor
    overflows: tf.Tensor

    def pack(self):
        return tf.nest.flatten(self)

    def unpack(self, flat):
        return tf.nest.pack_sequence_as(self, list(flat))
