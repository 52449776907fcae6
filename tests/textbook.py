"""Numpy textbook loops of the update rules in docs/algorithms/, in float64 and plain loops.

Each function runs ``rounds`` rounds of ``H`` inner SGD steps on every replica of a
:class:`Problem` and returns the parameters every replica starts the next round from, per
round: an array ``[rounds, R, dim]``. Nothing here imports co2jax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Problem:
    """Replica r minimises ``mean_k 0.5 * sum(d_r * (theta - c_{r,k})**2)``.

    Its gradient is ``d_r * (theta - mean_k c_{r,k})``: heterogeneous curvature and optimum.
    """

    d: np.ndarray  # [R, dim]
    c: np.ndarray  # [R, K, dim]
    theta0: np.ndarray  # [dim]

    @property
    def replicas(self) -> int:
        return self.d.shape[0]

    def grad(self, r: int, theta: np.ndarray) -> np.ndarray:
        return self.d[r] * (theta - self.c[r].mean(axis=0))


def make_problem(replicas: int = 4, examples: int = 2, dim: int = 5, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.5, 2.0, size=(replicas, dim))
    c = rng.normal(size=(replicas, examples, dim))
    theta0 = rng.normal(size=dim)
    return Problem(d, c, theta0)


def split_leaves(theta: np.ndarray, shapes) -> list[np.ndarray]:
    """A flat vector cut into consecutive leaves of ``shapes``."""
    out, offset = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(theta[offset : offset + n].reshape(s))
        offset += n
    return out


def inner_sgd(problem: Problem, r: int, theta: np.ndarray, lr: float, steps: int) -> np.ndarray:
    theta = theta.copy()
    for _ in range(steps):
        theta = theta - lr * problem.grad(r, theta)
    return theta


def _avg_pseudo_gradient(problem, anchor, lr, H):
    local = [inner_sgd(problem, r, anchor, lr, H) for r in range(problem.replicas)]
    return np.mean([anchor - x for x in local], axis=0)


def _record(history, x, replicas):
    """Appends what each replica starts the next round from: ``[R, dim]``."""
    history.append(np.stack(x) if isinstance(x, list) else np.stack([x] * replicas))


def local_sgd(problem: Problem, lr: float, H: int, rounds: int) -> np.ndarray:
    """theta^(t+1) = mean_r theta_r^(t,H)."""
    anchor, out = problem.theta0.copy(), []
    for _ in range(rounds):
        local = [inner_sgd(problem, r, anchor, lr, H) for r in range(problem.replicas)]
        anchor = np.mean(local, axis=0)
        _record(out, anchor, problem.replicas)
    return np.array(out)


def diloco_nesterov(problem, lr, H, rounds, eta, mu, delay=0):
    """b <- mu*b + g; theta <- theta - eta*(g + mu*b), g = Delta-bar^(t - delay).

    No outer step while t < delay: no average has arrived yet.
    """
    anchor, b, history, out = problem.theta0.copy(), 0.0, [], []
    for t in range(rounds):
        history.append(_avg_pseudo_gradient(problem, anchor, lr, H))
        if t >= delay:
            g = history[t - delay]
            b = mu * b + g
            anchor = anchor - eta * (g + mu * b)
        _record(out, anchor, problem.replicas)
    return np.array(out)


def diloco_scheduled(problem, lr, H, rounds, eta, mu, nesterov=True, restart_every=0):
    """DiLoCo with the outer hyper-parameters of outer step s: eta(s), mu(s) (functions).
    b <- mu_s*b + g; theta <- theta - eta_s*(g + mu_s*b) (Nesterov) or - eta_s*b; with
    ``restart_every`` = S, b <- 0 before outer step s when s > 0 and s % S == 0."""
    anchor, b, out = problem.theta0.copy(), 0.0, []
    for s in range(rounds):
        if restart_every and s > 0 and s % restart_every == 0:
            b = 0.0
        g = _avg_pseudo_gradient(problem, anchor, lr, H)
        b = mu(s) * b + g
        anchor = anchor - eta(s) * ((g + mu(s) * b) if nesterov else b)
        _record(out, anchor, problem.replicas)
    return np.array(out)


def diloco_adam(problem, lr, H, rounds, eta, b1, b2, eps=1e-8):
    """DiLoCo with outer Adam: m <- b1*m + (1-b1)*g; v <- b2*v + (1-b2)*g^2;
    theta <- theta - eta * (m / (1-b1^n)) / (sqrt(v / (1-b2^n)) + eps), n = s + 1."""
    anchor, m, v, out = problem.theta0.copy(), 0.0, 0.0, []
    for s in range(rounds):
        g = _avg_pseudo_gradient(problem, anchor, lr, H)
        m, v, n = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, s + 1
        anchor = anchor - eta * (m / (1 - b1**n)) / (np.sqrt(v / (1 - b2**n)) + eps)
        _record(out, anchor, problem.replicas)
    return np.array(out)


def eager_nesterov(problem, lr, H, rounds, eta, mu, delay=1):
    """Delta-hat_r^(t) = Delta-bar^(t-d) + (Delta_r^(t) - Delta_r^(t-d)) / R, replica-local.

    Delta^(s) = 0 for s < 0; each replica keeps its own anchor and Nesterov buffer.
    """
    R, zero = problem.replicas, np.zeros_like(problem.theta0)
    anchors = [problem.theta0.copy() for _ in range(R)]
    b = [zero.copy() for _ in range(R)]
    own, averages, out = [], [], []  # own[t][r] = Delta_r^(t); averages[t] = Delta-bar^(t)
    for t in range(rounds):
        own.append([anchors[r] - inner_sgd(problem, r, anchors[r], lr, H) for r in range(R)])
        averages.append(np.mean(own[t], axis=0))
        for r in range(R):
            old = own[t - delay][r] if t >= delay else zero
            stale = averages[t - delay] if t >= delay else zero
            g = stale + (own[t][r] - old) / R
            b[r] = mu * b[r] + g
            anchors[r] = anchors[r] - eta * (g + mu * b[r])
        _record(out, list(anchors), R)
    return np.array(out)


def slowmo(problem, lr, H, rounds, gamma, alpha, beta):
    """m <- beta*m + Delta-bar/gamma_t; theta <- theta - alpha*gamma_t*m."""
    anchor, m, out = problem.theta0.copy(), 0.0, []
    for t in range(rounds):
        g = _avg_pseudo_gradient(problem, anchor, lr, H)
        m = beta * m + g / gamma(t)
        anchor = anchor - alpha * gamma(t) * m
        _record(out, anchor, problem.replicas)
    return np.array(out)


def gap_aware_penalty(decay, eps=1e-12):
    """Returns a stateful Lambda(anchor, previous_anchor) per docs/algorithms/co2.md."""
    state = {"C": None, "n": 0}

    def penalty(anchor, previous_anchor):
        gap = np.abs(anchor - previous_anchor)
        C = np.zeros_like(anchor) if state["C"] is None else state["C"]
        c_hat = C / (1 - decay ** state["n"]) if state["n"] > 0 else np.zeros_like(C)
        lam = np.ones_like(anchor)
        has = c_hat > eps
        lam[has] = 1.0 / (1.0 + gap[has] / c_hat[has])
        state["C"], state["n"] = decay * C + (1 - decay) * gap, state["n"] + 1
        return lam

    return penalty


def co2_paper(problem, lr, H, rounds, alpha, beta, phi=None, penalty=None):
    """m = clip(beta*m + Lambda*Delta-bar^(t-1), -phi, phi); theta -= alpha*m.

    Delta-bar^(-1) = 0 makes the first outer step a no-op (m stays 0), so round 0 takes none:
    stateful penalties start at the first real average. ``alpha`` may be a function of the
    outer step (0 at the first real one); the penalty sees the anchor before the last step.
    """
    anchor, previous, m = problem.theta0.copy(), problem.theta0.copy(), 0.0
    stale, out, step = None, [], 0
    for _ in range(rounds):
        fresh = _avg_pseudo_gradient(problem, anchor, lr, H)
        new = anchor
        if stale is not None:
            lam = 1.0 if penalty is None else penalty(anchor, previous)
            m = beta * m + lam * stale
            if phi is not None:
                m = np.clip(m, -phi, phi)
            new = anchor - (alpha(step) if callable(alpha) else alpha) * m
            step += 1
        previous, anchor, stale = anchor, new, fresh
        _record(out, anchor, problem.replicas)
    return np.array(out)


def co2_reference_code(problem, lr, H, rounds, alpha, beta, lam=1.0):
    """The released code: synchronous average, m = beta*m + Delta-bar/lam, no clip."""
    anchor, m, out = problem.theta0.copy(), 0.0, []
    for _ in range(rounds):
        m = beta * m + _avg_pseudo_gradient(problem, anchor, lr, H) / lam
        anchor = anchor - alpha * m
        _record(out, anchor, problem.replicas)
    return np.array(out)


def data_parallel_sgd(problem, lr, H, rounds):
    """theta <- theta - lr * mean_r grad_r(theta), recorded every H steps."""
    theta, out = problem.theta0.copy(), []
    for _ in range(rounds):
        for _ in range(H):
            theta = theta - lr * np.mean(
                [problem.grad(r, theta) for r in range(problem.replicas)], axis=0
            )
        _record(out, theta, problem.replicas)
    return np.array(out)


def data_parallel_gpa(problem, lr, H, rounds, mu_y, mu_x, b1, b2, eps=1e-8):
    """GPA-AdamW on the replicas' mean gradient at y, in the released in-place form:
    m, v Adam's moments, u their bias-corrected step, c = 1 - mu_x;
    y <- y + c (z - y) + lr (mu_y (1 - c) - 1) u; z <- z - lr u. Records y every H steps."""
    y = problem.theta0.copy()
    z, m, v, c, k, out = y.copy(), np.zeros_like(y), np.zeros_like(y), 1 - mu_x, 0, []
    for _ in range(rounds):
        for _ in range(H):
            k += 1
            g = np.mean([problem.grad(r, y) for r in range(problem.replicas)], axis=0)
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            u = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
            y = y + c * (z - y) + lr * (mu_y * (1 - c) - 1) * u
            z = z - lr * u
        _record(out, y, problem.replicas)
    return np.array(out)


def int8_roundtrip(x, block):
    """Symmetric int8 with a float32 scale max|x|/127 per block of ``block`` (zero-padded),
    rounded half to even, in float32: what the int8 codec decodes to."""
    n = x.size
    xb = np.pad(np.asarray(x, np.float32), (0, (-n) % block)).reshape(-1, block)
    s = (np.abs(xb).max(axis=1) / np.float32(127.0)).astype(np.float32)
    q = np.round(xb / np.where(s > 0, s, np.float32(1.0))[:, None])
    return (q * s[:, None]).astype(np.float32).reshape(-1)[:n]


def weighted_mean(xs, w):
    """sum_r w_r x_r / sum_r w_r."""
    w = np.asarray(w, np.float64)
    return sum(wr * x for wr, x in zip(w, xs, strict=True)) / w.sum()


def streaming_nesterov(
    problem, lr, H, rounds, fragments, tau, alpha, eta, mu, compress=None, decay=1.0, weights=None
):
    """Streaming DiLoCo: fragment p (flat indices) applied after (p+1)*H//P steps, sent tau
    steps earlier; Nesterov per fragment on the global copy; merge alpha*local + (1-alpha)*
    global. Returns every replica's local parameters at the end of each round.

    ``compress`` (a vector -> decoded vector function) sends each fragment with error
    feedback: at the send step ``t = Delta + decay * e; c = compress(t); e = t - c`` per
    replica and fragment, and the mean of the ``c`` is applied ``tau`` steps later.
    ``weights`` (w[t][r] >= 0): round t's fragments are the w[t]-weighted means instead."""
    R, P = problem.replicas, len(fragments)
    e = [[np.zeros(len(idx)) for idx in fragments] for _ in range(R)]
    local = [problem.theta0.copy() for _ in range(R)]
    glob = problem.theta0.copy()
    b = [np.zeros(len(idx)) for idx in fragments]
    apply_at = [(p + 1) * H // P for p in range(P)]
    send_at = [a - tau for a in apply_at]
    sent, out = {}, []
    for t in range(rounds):
        w = np.ones(R) if weights is None else weights[t]
        for k in range(H + 1):
            for p, idx in enumerate(fragments):
                if send_at[p] == k:
                    deltas = [glob[idx] - local[r][idx] for r in range(R)]
                    if compress is not None:
                        for r in range(R):
                            target = deltas[r] + decay * e[r][p]
                            deltas[r] = compress(target)
                            e[r][p] = target - deltas[r]
                    sent[p] = weighted_mean(deltas, w)
                if apply_at[p] == k:
                    g = sent.pop(p)
                    b[p] = mu * b[p] + g
                    glob[idx] = glob[idx] - eta * (g + mu * b[p])
                    for r in range(R):
                        local[r][idx] = alpha * local[r][idx] + (1 - alpha) * glob[idx]
            if k < H:
                local = [x - lr * problem.grad(r, x) for r, x in enumerate(local)]
        out.append(np.stack(local))
    return np.array(out)


def _topk_ternary(e, k, chunk, quantize):
    """Per chunk: the k largest |e| kept (ternary 2-bit with scale max|kept| if quantize)."""
    out, support = np.zeros_like(e), np.zeros_like(e)
    for start in range(0, e.size, chunk):
        seg = e[start : start + chunk]
        keep = np.argsort(-np.abs(seg), kind="stable")[:k]
        vals = seg[keep]
        if quantize:
            s = np.abs(vals).max()
            vals = np.where(vals >= s / 2, s, np.where(vals <= -s / 2, -s, 0.0)) if s > 0 else vals
        out[start + keep] = vals
        support[start + keep] = 1.0
    return out, support


def sparseloco(problem, lr, H, rounds, alpha, beta, k, chunk, quantize=True):
    """e_r <- beta*e_r + Delta_r; sent_r = Q(TopK(e_r)); e_r -= sent_r;
    theta <- theta - alpha * (sum_r sent_r / #contributors per index)."""
    R = problem.replicas
    anchor, out = problem.theta0.copy(), []
    e = [np.zeros_like(anchor) for _ in range(R)]
    for _ in range(rounds):
        total, count = np.zeros_like(anchor), np.zeros_like(anchor)
        for r in range(R):
            e[r] = beta * e[r] + (anchor - inner_sgd(problem, r, anchor, lr, H))
            sent, support = _topk_ternary(e[r], k, chunk, quantize)
            e[r] = e[r] - sent
            total, count = total + sent, count + support
        anchor = anchor - alpha * total / np.maximum(count, 1.0)
        _record(out, anchor, R)
    return np.array(out)


def noloco(problem, lr, H, rounds, eta, mu, n=2):
    """The released NoLoCo rule: after inner step s = (t+1)*H the replicas are permuted by
    default_rng(s + 1), dealt round-robin into R/n groups; per replica, with its group G:
    delta <- mu*delta + eta*mean_G(theta - phi) + eta*(mean_G(phi) - phi); phi <- phi + delta.
    Returns every replica's anchor per round."""
    R = problem.replicas
    phi = [problem.theta0.copy() for _ in range(R)]
    delta = [np.zeros_like(problem.theta0) for _ in range(R)]
    out = []
    for t in range(rounds):
        theta = [inner_sgd(problem, r, phi[r], lr, H) for r in range(R)]
        perm = [int(x) for x in np.random.default_rng((t + 1) * H + 1).permutation(R)]
        count = R // n
        groups = [perm[g::count] for g in range(count)]
        new_phi = []
        for r in range(R):
            group = next(g for g in groups if r in g)
            g_bar = np.mean([theta[j] - phi[j] for j in group], axis=0)
            phi_bar = np.mean([phi[j] for j in group], axis=0)
            delta[r] = mu * delta[r] + eta * g_bar + eta * (phi_bar - phi[r])
            new_phi.append(phi[r] + delta[r])
        phi = new_phi
        _record(out, list(phi), R)
    return np.array(out)


def hierarchical(problem, lr, H, rounds, regions, every, alpha, local, global_):
    """HALoS's synchronous two-level rule. Regions: blocks of R / G contiguous replicas.
    Every round, per region g: Delta_g = mean_{r in g}(phi_g - x_r);
    b_g <- mu_L*b_g + Delta_g; phi_g <- phi_g - eta_L*(Delta_g + mu_L*b_g). After rounds
    K, 2K, ...: U = mean_g(ref_g - phi_g); c <- mu_G*c + U; theta <- theta - eta_G*(U + mu_G*c);
    phi_g <- (1 - alpha)*phi_g + alpha*theta; ref_g <- phi_g. ``local`` and ``global_`` are
    (eta, mu) of the two Nesterov SGD steps. Returns every replica's phi_g per round."""
    R = problem.replicas
    m = R // regions
    (eta_l, mu_l), (eta_g, mu_g) = local, global_
    phi = [problem.theta0.copy() for _ in range(regions)]
    ref = [problem.theta0.copy() for _ in range(regions)]
    b = [np.zeros_like(problem.theta0) for _ in range(regions)]
    theta, c, out = problem.theta0.copy(), np.zeros_like(problem.theta0), []
    for t in range(rounds):
        for g in range(regions):
            members = range(g * m, (g + 1) * m)
            delta = np.mean([phi[g] - inner_sgd(problem, r, phi[g], lr, H) for r in members], 0)
            b[g] = mu_l * b[g] + delta
            phi[g] = phi[g] - eta_l * (delta + mu_l * b[g])
        if t % every == every - 1:
            u = np.mean([ref[g] - phi[g] for g in range(regions)], axis=0)
            c = mu_g * c + u
            theta = theta - eta_g * (u + mu_g * c)
            phi = [(1 - alpha) * p + alpha * theta for p in phi]
            ref = [p.copy() for p in phi]
        _record(out, [phi[r // m] for r in range(R)], R)
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# One entry per algorithm of co2jax's registry: the settings the shared tests build it from
# (fields of its co2jax.algorithms.registry settings class) and its loop
# ``(problem, lr, H, rounds)``.
# Streaming DiLoCo's fragments are the registry's default: one leaf each, "b" (indices 0, 1)
# and "w" (the rest); its two fragments need H // 2 > tau = 1, so the shared tests use H = 4.

REGISTERED_H = 4


def _streaming_registered(problem, lr, H, rounds):
    dim = problem.d.shape[1]
    fragments = [[0, 1], list(range(2, dim))]
    return streaming_nesterov(problem, lr, H, rounds, fragments, 1, 0.5, 0.7, 0.9)


def _cocodc_registered(problem, lr, H, rounds):
    from textbook_cocodc import cocodc_nesterov

    dim = problem.d.shape[1]
    fragments = [[0, 1], list(range(2, dim))]
    return cocodc_nesterov(problem, lr, H, rounds, fragments, 1, 0.5, 0.7, 0.9, "zeroth")[0]


def _dct_diloco_registered(problem, lr, H, rounds):
    from textbook_dct import dct_diloco

    return dct_diloco(problem, lr, H, rounds, 0.7, 0.95, 3, 8)


def _demo_registered(problem, lr, H, rounds):
    from textbook_dct import demo

    return demo(problem, lr, H, rounds, 0.9, 3, 8)


def _diloco_x_registered(problem, lr, H, rounds):
    from textbook_lowrank import diloco_x

    shapes = ((2,), (problem.d.shape[1] - 2,))  # 1-D leaves: sent dense, in int4
    return diloco_x(problem, lr, H, rounds, 0.5, 0.5, shapes, 32, ())[0]


def _sparta_draw(fraction, selector="indices", seed=0):
    """The entries SPARTA averages, as co2jax draws them (JAX's PRNG: the rule's randomness)."""
    from co2jax.algorithms.sparta import sparta_indices, sparta_mask

    def draw(t, leaf, n):
        if selector == "bernoulli":
            return np.flatnonzero(np.asarray(sparta_mask(seed, t, leaf, (n,), fraction)))
        idx = sparta_indices(seed, t, leaf, n, fraction)
        return None if idx is None else np.asarray(idx)

    return draw


def _sparta_registered(outer=None, every=1, selector="indices"):
    from textbook_sparta import sparta

    def loop(problem, lr, H, rounds):
        sizes = (2, problem.d.shape[1] - 2)  # tests/harness.py's leaves b and w
        draw = _sparta_draw(0.25, selector)
        return sparta(problem, lr, H, rounds, draw, sizes, every=every, outer=outer)

    return loop


def _desloc_registered(problem, lr, H, rounds):
    from textbook_desloc import desloc_adam

    # Adam inside (tests/harness.py::INNER); first moments every round, second every two
    return desloc_adam(problem, lr, H, rounds, H, 2 * H, b1=0.9, b2=0.95)


def _muloco_registered(problem, lr, H, rounds):
    from textbook_muloco import diloco_feedback

    # the shared leaves are vectors: the run's SGD (Muon's matrices: tests/test_muloco.py);
    # int8 in one block of 128, error feedback 0.9 carrying the outer learning rate 0.9
    return diloco_feedback(problem, lr, H, rounds, 0.9, 0.8, 0.9, 128)


REGISTERED = {
    "ddp": ({}, data_parallel_sgd),
    "local_sgd": ({}, local_sgd),
    "slowmo": (
        {"learning_rate": 0.9, "momentum": 0.6},
        lambda p, lr, H, rounds: slowmo(p, lr, H, rounds, lambda t: lr, alpha=0.9, beta=0.6),
    ),
    "diloco": (
        {"learning_rate": 0.7, "momentum": 0.9},
        lambda p, lr, H, rounds: diloco_nesterov(p, lr, H, rounds, 0.7, 0.9),
    ),
    "delayed_diloco": (
        {"learning_rate": 0.5, "momentum": 0.5, "delay": 1},
        lambda p, lr, H, rounds: diloco_nesterov(p, lr, H, rounds, 0.5, 0.5, delay=1),
    ),
    "eager_diloco": (
        {"learning_rate": 0.7, "momentum": 0.5, "delay": 1},
        lambda p, lr, H, rounds: eager_nesterov(p, lr, H, rounds, 0.7, 0.5, delay=1),
    ),
    # a one-round-stale step with heavy momentum oscillates: keep beta small (as the released
    # code does for few replicas); the clip binds on the first rounds
    "co2": (
        {"learning_rate": 1.0, "momentum": 0.2, "clip_threshold": 0.3},
        lambda p, lr, H, rounds: co2_paper(p, lr, H, rounds, 1.0, 0.2, phi=0.3),
    ),
    "streaming_diloco": (
        {"learning_rate": 0.7, "momentum": 0.9, "fragments": 2, "tau": 1, "alpha": 0.5},
        _streaming_registered,
    ),
    # k < chunk (16 parameters: two chunks of 8, the top 4 of each), 2-bit values
    "sparseloco": (
        {"learning_rate": 1.0, "decay": 0.95, "topk": 4, "chunk": 8},
        lambda p, lr, H, rounds: sparseloco(p, lr, H, rounds, 1.0, 0.95, 4, 8, True),
    ),
    # the two 1-D leaves in DCT chunks of 8 (largest divisors: 2 and 7), the top 3 of each
    "dct_diloco": (
        {"learning_rate": 0.7, "decay": 0.95, "topk": 3, "dct_chunk": 8},
        _dct_diloco_registered,
    ),
    "demo": ({"momentum": 0.9, "topk": 3, "dct_chunk": 8}, _demo_registered),
    # Streaming DiLoCo's setting with the zeroth-order delay compensation
    "cocodc": (
        {"learning_rate": 0.7, "momentum": 0.9, "fragments": 2, "tau": 1, "alpha": 0.5},
        _cocodc_registered,
    ),
    # one round of delay; the shared problem's leaves are vectors: int4, no factors (the
    # low-rank path is matched in tests/test_lowrank.py)
    "diloco_x": (
        {"learning_rate": 0.5, "momentum": 0.5, "delay": 1, "rank": 32, "factors": "int4"},
        _diloco_x_registered,
    ),
    # groups of 2 of the 4 replicas: the anchors differ between groups
    "noloco": (
        {"learning_rate": 0.7, "momentum": 0.5, "group_size": 2},
        lambda p, lr, H, rounds: noloco(p, lr, H, rounds, 0.7, 0.5, 2),
    ),
    # two regions of two replicas, a global step every other round (so one in the usual 3
    # rounds, after which the regions differ: alpha < 1), momentum at both levels
    "hierarchical_diloco": (
        {
            "learning_rate": 0.7,
            "momentum": 0.6,
            "regions": 2,
            "global_every": 2,
            "global_learning_rate": 0.9,
            "global_momentum": 0.5,
            "alpha": 0.75,
        },
        lambda p, lr, H, rounds: hierarchical(p, lr, H, rounds, 2, 2, 0.75, (0.7, 0.6), (0.9, 0.5)),
    ),
    # a quarter of each leaf every step (w: 4 of 14 entries; b: 1 of 2), drawn with replacement
    "sparta": ({"fraction": 0.25}, _sparta_registered()),
    "sparta_diloco": (
        {"fraction": 0.25, "learning_rate": 0.7, "momentum": 0.9},
        _sparta_registered(outer=(0.7, 0.9)),
    ),
    # Adam moments averaged on their own periods (1 and 2 rounds), parameters every round
    "desloc": ({"first_moment_every": 1, "second_moment_every": 2}, _desloc_registered),
    "muloco": ({"compression": "int8", "collective": "all_gather"}, _muloco_registered),
}


def _sparseloco_production_registered(problem, lr, H, rounds):
    from textbook_sparseloco import sparseloco_production

    return sparseloco_production(problem, lr, H, rounds, 1.0, 0.95, 4, (64, 64), 16)


# Second modes of a registered algorithm: (algorithm, config overrides, loop), run in the same
# drivers. SparseLoCo's production quantizer: the top 4 of each leaf (k < the chunk of 16).
VARIANTS = {
    "sparseloco[production]": (
        "sparseloco",
        {"learning_rate": 1.0, "decay": 0.95, "topk": 4, "chunk": 16, "quantizer": "production"},
        _sparseloco_production_registered,
    ),
    # the outer momentum ramped from 0 over 2 outer steps and restarted before step 2
    "diloco[momentum_schedule]": (
        "diloco",
        {"learning_rate": 0.7, "momentum": 0.9, "momentum_warmup": 2, "momentum_restart": 2},
        lambda p, lr, H, rounds: diloco_scheduled(
            p, lr, H, rounds, lambda s: 0.7, lambda s: 0.9 * min(s, 2) / 2, restart_every=2
        ),
    ),
    # GPA-AdamW inside DDP (tests/harness.py::INNER): every step on the mean gradient at y
    "ddp[gpa]": (
        "ddp",
        {},
        lambda p, lr, H, rounds: data_parallel_gpa(p, lr, H, rounds, 0.7, 0.8, 0.9, 0.95),
    ),
    # SPARTA's released law (independent entries), averaged on every other step
    "sparta[bernoulli]": (
        "sparta",
        {"fraction": 0.25, "selector": "bernoulli", "every": 2},
        _sparta_registered(every=2, selector="bernoulli"),
    ),
}


def loop_of(name: str):
    """The textbook loop of a registered algorithm or of a variant."""
    return VARIANTS[name][2] if name in VARIANTS else REGISTERED[name][1]
