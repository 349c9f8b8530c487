"""Plain NumPy transcription of the update rules of issue 2, for a small two-layer MLP.

Written from the equations, independently of crossbow_tf: its own forward pass, hand-written
back-propagation, slicing of iterations into learners, learning-rate drops and resets.
"""
import numpy as np


def mlp_loss_grads(params, x, y):
    """Mean softmax cross-entropy of tanh-MLP logits over the examples, and its gradients."""
    w1, b1, w2, b2 = params
    n = len(y)
    if n == 0:
        return 0.0, [np.zeros_like(p) for p in params]
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(n), y]).mean()
    dlogits = p.copy()
    dlogits[np.arange(n), y] -= 1.0
    dlogits /= n
    dw2 = h.T @ dlogits
    db2 = dlogits.sum(0)
    dpre = (dlogits @ w2.T) * (1.0 - h ** 2)
    dw1 = x.T @ dpre
    db1 = dpre.sum(0)
    return loss, [dw1, db1, dw2, db2]


def learner_slices(num_examples, k, b, iteration):
    """Index ranges of learner j's slice in ITERATION (consecutive slices of b, clipped at N)."""
    start = iteration * k * b
    return [np.arange(min(start + j * b, num_examples), min(start + (j + 1) * b, num_examples))
            for j in range(k)]


def lr_at(t, base, drops, factor):
    return base * factor ** sum(t >= d for d in drops)


def run_reference(algorithm, params0, x, y, k, b, iterations, base_lr, drops=(), factor=0.1,
                  mu=0.9, mu_z=0.9, wd=0.0, alpha=None, central_step=None, period=1, synchronised=None,
                  outer_lr=1.0, outer_mu=0.0, nesterov=False):
    """Runs ITERATIONS iterations (wrapping into further epochs in the same order).

    CENTRAL_STEP (SMA): Delta = central_step * mean_j (s_j - z) instead of sum_j delta_j.
    PERIOD: iteration t synchronises when (t + 1) % PERIOD == 0 (SMA, EASGD, local SGD), or when
    SYNCHRONISED(t) says so; the others are the learners' own momentum steps only.
    Local SGD ("localsgd"): every learner steps; at a synchronisation g_o = z - mean_j w_j,
    u = outer_mu*u + g_o, z = z - outer_lr*(g_o + outer_mu*u) (NESTEROV) or z - outer_lr*u, and
    every learner restarts from z (velocities kept).
    Returns (z, learners' weights).
    """
    if synchronised is None:
        def synchronised(t):
            return (t + 1) % period == 0
    n = len(y)
    per_epoch = -(-n // (k * b))
    z = [p.astype(np.float64).copy() for p in params0]
    u = [np.zeros_like(p) for p in z]
    w = [[p.copy() for p in z] for _ in range(k)]
    v = [[np.zeros_like(p) for p in z] for _ in range(k)]
    if alpha is None:
        alpha = 1.0 / k if algorithm == "sma" else 0.9 / k
    for t in range(iterations):
        lr = lr_at(t, base_lr, drops, factor)
        if algorithm == "sma" and t > 0 and lr < lr_at(t - 1, base_lr, drops, factor):
            w = [[p.copy() for p in z] for _ in range(k)]
        slices = learner_slices(n, k, b, t % per_epoch)
        if algorithm == "localsgd" or (algorithm in ("sma", "easgd") and not synchronised(t)):
            for j, s in enumerate(slices):
                _, g = mlp_loss_grads(w[j], x[s], y[s])
                for i in range(len(z)):
                    v[j][i] = mu * v[j][i] - lr * (g[i] + wd * w[j][i])
                    w[j][i] = w[j][i] + v[j][i]
            if algorithm == "localsgd" and synchronised(t):
                for i in range(len(z)):
                    g_o = z[i] - sum(w[j][i] for j in range(k)) / k
                    u[i] = outer_mu * u[i] + g_o
                    z[i] = z[i] - outer_lr * ((g_o + outer_mu * u[i]) if nesterov else u[i])
                w = [[p.copy() for p in z] for _ in range(k)]
            continue
        if algorithm == "ssgd":
            total = sum(len(s) for s in slices)
            G = [np.zeros_like(p) for p in z]
            for s in slices:
                _, g = mlp_loss_grads(z, x[s], y[s])
                for i in range(len(z)):
                    G[i] += len(s) / total * g[i]
            for i in range(len(z)):
                u[i] = mu * u[i] - lr * (G[i] + wd * z[i])
                z[i] = z[i] + u[i]
            w = [[p.copy() for p in z] for _ in range(k)]
            continue
        deltas, differences = [], []
        for j, s in enumerate(slices):
            _, g = mlp_loss_grads(w[j], x[s], y[s])
            delta_j, difference_j = [], []
            for i in range(len(z)):
                if algorithm == "sma":
                    snapshot = w[j][i].copy()
                    gi = g[i] + wd * w[j][i]
                    v[j][i] = mu * v[j][i] - lr * gi
                    w[j][i] = w[j][i] + v[j][i]
                    d = alpha * (snapshot - z[i])
                    difference_j.append(snapshot - z[i])
                    w[j][i] = w[j][i] - d
                else:  # easgd
                    d = alpha * (w[j][i] - z[i])
                    v[j][i] = mu * v[j][i] - lr * (g[i] + wd * w[j][i])
                    w[j][i] = w[j][i] + v[j][i] - d
                delta_j.append(d)
            deltas.append(delta_j)
            differences.append(difference_j)
        for i in range(len(z)):
            total = sum(d[i] for d in deltas)
            if algorithm == "sma" and central_step is not None:
                total = central_step * sum(e[i] for e in differences) / k
            if algorithm == "sma":
                u[i] = mu_z * u[i] + total
                z[i] = z[i] + u[i]
            else:
                z[i] = z[i] + total
    return z, w


# --- Keras optimizers for the learners, transcribed from the equations in Keras's documentation ----
# Keras's order in one step: clip the gradients (by each tensor's norm, or by their global norm),
# decoupled weight decay w = w - lr*wd*w, then the optimizer's update with t = steps taken so far.

def _clip(grads, clipnorm=None, global_clipnorm=None):
    if clipnorm:
        return [g * clipnorm / max(np.sqrt((g ** 2).sum()), clipnorm) for g in grads]
    if global_clipnorm:
        norm = np.sqrt(sum((g ** 2).sum() for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    return grads


class NumpyAdam:
    """Adam (Kingma & Ba) as Keras writes it: m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
    w = w - lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v) + eps), t counting from 1; WEIGHT_DECAY makes it
    AdamW (Loshchilov & Hutter: w = w - lr*wd*w first)."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None, clipnorm=None, global_clipnorm=None):
        self.beta_1, self.beta_2, self.epsilon, self.weight_decay = beta_1, beta_2, epsilon, weight_decay
        self.clipnorm, self.global_clipnorm = clipnorm, global_clipnorm

    def init(self, params):
        return {"t": 0, "m": [np.zeros_like(p) for p in params], "v": [np.zeros_like(p) for p in params]}

    def step(self, params, grads, state, lr):
        grads = _clip(grads, self.clipnorm, self.global_clipnorm)
        t = state["t"] + 1
        out = []
        for i, (w, g) in enumerate(zip(params, grads)):
            if self.weight_decay:
                w = w - lr * self.weight_decay * w
            state["m"][i] = self.beta_1 * state["m"][i] + (1 - self.beta_1) * g
            state["v"][i] = self.beta_2 * state["v"][i] + (1 - self.beta_2) * g ** 2
            rate = lr * np.sqrt(1 - self.beta_2 ** t) / (1 - self.beta_1 ** t)
            out.append(w - rate * state["m"][i] / (np.sqrt(state["v"][i]) + self.epsilon))
        state["t"] = t
        return out


class NumpyRMSprop:
    """RMSprop as Keras writes it: v = rho*v + (1-rho)*g^2 (centered: also a = rho*a + (1-rho)*g and
    v - a^2 in the denominator); step = lr*g/sqrt(v + eps); with MOMENTUM mu: s = mu*s + step, w = w - s."""

    def __init__(self, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False):
        self.rho, self.momentum, self.epsilon, self.centered = rho, momentum, epsilon, centered

    def init(self, params):
        zeros = lambda: [np.zeros_like(p) for p in params]  # noqa: E731
        return {"v": zeros(), "a": zeros(), "s": zeros()}

    def step(self, params, grads, state, lr):
        out = []
        for i, (w, g) in enumerate(zip(params, grads)):
            state["v"][i] = self.rho * state["v"][i] + (1 - self.rho) * g ** 2
            denominator = state["v"][i]
            if self.centered:
                state["a"][i] = self.rho * state["a"][i] + (1 - self.rho) * g
                denominator = denominator - state["a"][i] ** 2
            step = lr * g / np.sqrt(denominator + self.epsilon)
            if self.momentum:
                state["s"][i] = self.momentum * state["s"][i] + step
                step = state["s"][i]
            out.append(w - step)
        return out


def noise_stretch(a, c, k):
    """sqrt(a / c) clipped to [1, sqrt(k)]; 1 where nothing has been seen (a = c = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(c > 0, a / np.where(c > 0, c, 1.0), np.where(a > 0, np.inf, 1.0))
    return np.sqrt(np.clip(ratio, 1.0, k))


def run_reference_optimizer(algorithm, optimizer, params0, x, y, k, b, iterations, base_lr, drops=(), factor=0.1,
                            mu_z=0.9, alpha=None, period=1, outer_lr=1.0, outer_mu=0.0, nesterov=False,
                            noise_decay=None):
    """As run_reference, with every learner taking OPTIMIZER's step (its own state, kept across
    SMA's resets at a drop) in place of the momentum step. SMA: s = w; w = step(w); w = w - alpha*(s - z);
    u = mu_z*u + sum_j alpha*(s_j - z); z = z + u. EASGD: the same correction, z = z + sum_j alpha*(s_j - z).
    Local SGD: as run_reference's. Returns (z, learners).

    NOISE_DECAY (noise matching): after the iteration's update, z and every learner move on by
    (f - 1) * mean_j(step(s_j) - s_j), f = sqrt(clip(a / c, 1, k)) per coordinate, where a and c are
    running means (decay NOISE_DECAY, from 0, updated after that) of sum_j p_j g_j^2 and of
    (sum_j p_j g_j)^2, p_j being learner j's share of the iteration's examples."""
    n = len(y)
    per_epoch = -(-n // (k * b))
    z = [p.astype(np.float64).copy() for p in params0]
    u = [np.zeros_like(p) for p in z]
    w = [[p.copy() for p in z] for _ in range(k)]
    states = [optimizer.init(z) for _ in range(k)]
    if alpha is None:
        alpha = 0.9 / k if algorithm == "easgd" else 1.0 / k
    a = [np.zeros_like(p) for p in z]
    c = [np.zeros_like(p) for p in z]
    for t in range(iterations):
        lr = lr_at(t, base_lr, drops, factor)
        if algorithm == "sma" and t > 0 and lr < lr_at(t - 1, base_lr, drops, factor):
            w = [[p.copy() for p in z] for _ in range(k)]
        synchronising = (t + 1) % period == 0
        totals = [np.zeros_like(p) for p in z]
        slices = learner_slices(n, k, b, t % per_epoch)
        shares = [len(s) / sum(len(q) for q in slices) for s in slices]
        mean_g = [np.zeros_like(p) for p in z]
        mean_square = [np.zeros_like(p) for p in z]
        mean_step = [np.zeros_like(p) for p in z]
        for j, s in enumerate(slices):
            _, g = mlp_loss_grads(w[j], x[s], y[s])
            before = w[j]
            w[j] = optimizer.step(before, g, states[j], lr)
            for i in range(len(z)):
                mean_g[i] += shares[j] * g[i]
                mean_square[i] += shares[j] * g[i] ** 2
                mean_step[i] += (w[j][i] - before[i]) / k
            if algorithm in ("sma", "easgd") and synchronising:
                for i in range(len(z)):
                    delta = alpha * (before[i] - z[i])
                    w[j][i] = w[j][i] - delta
                    totals[i] += delta
        if not synchronising:
            continue
        for i in range(len(z)):
            if algorithm == "sma":
                u[i] = mu_z * u[i] + totals[i]
                z[i] = z[i] + u[i]
            elif algorithm == "easgd":
                z[i] = z[i] + totals[i]
            else:  # localsgd
                g_o = z[i] - sum(w[j][i] for j in range(k)) / k
                u[i] = outer_mu * u[i] + g_o
                z[i] = z[i] - outer_lr * ((g_o + outer_mu * u[i]) if nesterov else u[i])
        if noise_decay is not None:
            for i in range(len(z)):
                shift = (noise_stretch(a[i], c[i], k) - 1.0) * mean_step[i]
                z[i] = z[i] + shift
                for j in range(k):
                    w[j][i] = w[j][i] + shift
            a = [noise_decay * ai + (1 - noise_decay) * q for ai, q in zip(a, mean_square)]
            c = [noise_decay * ci + (1 - noise_decay) * q ** 2 for ci, q in zip(c, mean_g)]
        if algorithm == "localsgd":
            w = [[p.copy() for p in z] for _ in range(k)]
    return z, w
